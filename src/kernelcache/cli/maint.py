"""The CLI's maintenance commands: verify, prune, clear, export, import.

Each opens the tiers the settings describe (:func:`~kernelcache.cli.common.open_cache`)
and works through :mod:`kernelcache.maintenance`, so caps, read-only flags and
every configured tier apply as they do for a user's ``Cache()``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

from kernelcache import bundle, maintenance
from kernelcache.cache import Cache
from kernelcache.cli.common import named, open_cache
from kernelcache.cli.output import Progress, print_json
from kernelcache.errors import ConfigError, StoreError
from kernelcache.settings import Settings
from kernelcache.stats import totals as stats_file
from kernelcache.stores.base import Store
from kernelcache.units import format_size


def _writable(tiers: list[Store]) -> list[Store]:
    return [tier for tier in maintenance.persistent(tiers) if not tier.read_only]


def _forget_keys(cache: Cache, keep: set[str] | None) -> None:
    """Drop per-key hit counts of removed entries (all of them when ``keep`` is None)."""
    if cache.stats_dir is not None:
        stats_file.forget_keys(cache.stats_dir, keep)


def cmd_verify(args: argparse.Namespace, settings: Settings) -> int:
    with open_cache(settings, write=args.fix) as cache:
        listed = sum(1 for _ in maintenance.entries(cache.tiers))
        progress = Progress("verify", listed)
        bad = maintenance.verify(
            cache.tiers, fix=args.fix, progress=lambda d, _t: progress.update(d)
        )
        progress.close()
        if args.fix and bad:
            keep = {info.key for _tier, info in maintenance.entries(cache.tiers)}
            _forget_keys(cache, keep)
    report = [{"key": d.key, "error": d.reason, "removed": d.removed} for d in bad]
    if args.json:
        print_json({"checked": listed, "bad": report})
    else:
        for item in report:
            action = "removed" if item["removed"] else "damaged"
            print(f"{action}: {item['key']}: {item['error']}")
        print(f"checked {listed} entries: {listed - len(bad)} ok, {len(bad)} damaged")
    return 0 if all(d.removed for d in bad) else 1


def cmd_prune(args: argparse.Namespace, settings: Settings) -> int:
    if args.max_size is None and args.max_entries is None and args.older_than is None:
        raise ConfigError("prune needs at least one of --max-size, --max-entries, --older-than")
    with open_cache(settings, write=True) as cache:
        removed = freed = kept = kept_bytes = 0
        for tier in _writable(cache.tiers):
            progress = Progress("prune", 0)
            result = maintenance.prune(
                tier,
                max_bytes=args.max_size,
                max_entries=args.max_entries,
                older_than=args.older_than,
                progress=progress.set,
            )
            progress.close()
            tier.sweep()
            removed, freed = removed + result.removed, freed + result.freed
            kept, kept_bytes = kept + result.kept, kept_bytes + result.kept_bytes
        if removed:
            _forget_keys(cache, {i.key for _t, i in maintenance.entries(cache.tiers)})
    print(
        f"removed {removed} entries ({format_size(freed)}); "
        f"{kept} entries ({format_size(kept_bytes)}) remain"
    )
    return 0


def cmd_clear(args: argparse.Namespace, settings: Settings) -> int:
    with open_cache(settings, write=False) as cache:
        count = sum(1 for _ in maintenance.entries(cache.tiers))
        where = ", ".join(
            f"{name} {tier!r}" for name, tier in named(cache.tiers) if not tier.in_process
        )
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"refusing to clear {where} without --yes (no terminal)")
        answer = input(f"Remove all {count} entries from {where}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    if not count:
        print("removed 0 entries")  # and create nothing where there was no cache
        return 0
    removed = 0
    with open_cache(settings, write=True) as cache:
        for tier in _writable(cache.tiers):
            removed += tier.clear()
            tier.sweep()
        _forget_keys(cache, None)
    print(f"removed {removed} entries from {where}")
    return 0


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    cutoff = time.time() - args.since if args.since is not None else None
    with open_cache(settings, write=False) as cache:
        listed = [
            (tier, info)
            for tier, info in maintenance.entries(cache.tiers)
            if cutoff is None or info.last_access >= cutoff
        ]
        progress = Progress("export", len(listed))
        damaged = 0
        seen: set[str] = set()
        # Written beside the target and renamed into place: never a partial bundle.
        tmp = f"{args.file}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                writer = bundle.BundleWriter(f)
                for done, (tier, info) in enumerate(listed, 1):
                    if info.key not in seen:  # the fastest tier's copy of a key wins
                        entry = _get(tier, info.key)
                        if entry is not None:
                            writer.add(entry, info.key)
                            seen.add(info.key)
                        elif tier.info(info.key) is not None:
                            damaged += 1  # present but fails verification: not exported
                    progress.update(done)
                writer.finish()
            os.replace(tmp, args.file)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        progress.close()
    note = f"; skipped {damaged} damaged (run `kernelcache verify --fix`)" if damaged else ""
    print(f"exported {writer.count} entries ({format_size(writer.bytes)}) to {args.file}{note}")
    return 0


def _get(tier: Store, key: str) -> Any:
    try:
        return tier.get(key)
    except StoreError:
        return None  # counted by the tier


def cmd_import(args: argparse.Namespace, settings: Settings) -> int:
    with open_cache(settings, write=True) as cache:
        if not _writable(cache.tiers):
            raise ConfigError("no writable tier to import into (read-only settings?)")
        if args.inductor:
            return _import_inductor(args.file, cache)
        progress = Progress("import", 0)
        try:
            # "-" reads standard input: a bundle can arrive through a pipe.
            with contextlib.ExitStack() as stack:
                source = (
                    sys.stdin.buffer
                    if args.file == "-"
                    else stack.enter_context(open(args.file, "rb"))
                )
                result = bundle.import_bundle(source, cache, progress=progress.set)
        except (bundle.BundleError, StoreError, OSError) as exc:
            progress.close()
            print(f"kernelcache: error: {args.file}: {exc}; nothing imported", file=sys.stderr)
            return 1
        progress.close()
    for key in result.conflicts:
        print(f"kernelcache: kept the stored entry of {key}: the bundle's differs", file=sys.stderr)
    print(
        f"imported {result.added} entries from {args.file} ({result.present} were already present)"
    )
    return 0


def _import_inductor(file: str, cache: Cache) -> int:
    try:
        from kernelcache.inductor.megacache import publish_artifacts
    except ModuleNotFoundError as exc:
        print(f"kernelcache: error: {exc}", file=sys.stderr)
        return 1
    try:
        with open(sys.stdin.fileno() if file == "-" else file, "rb", closefd=file != "-") as f:
            counts = publish_artifacts(f.read(), cache)
    except (ValueError, OSError, StoreError) as exc:
        print(f"kernelcache: error: {file}: {exc}", file=sys.stderr)
        return 1
    shown = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "nothing"
    print(f"imported torch.compile artifacts from {file}: {shown}")
    return 0
