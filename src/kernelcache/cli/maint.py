"""The CLI's maintenance commands: verify, prune, clear, export, import.

Each opens the tiers the settings describe (:func:`~kernelcache.cli.common.open_cache`)
and works through :mod:`kernelcache.maintenance`, so caps, read-only flags and
every configured tier apply as they do for a user's ``Cache()``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from typing import Any

from kernelcache import bundle, maintenance
from kernelcache.cache import Cache
from kernelcache.cli.common import (
    named,
    open_cache,
    refuse_read_only,
    require_cache,
    targets,
)
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
    require_cache(settings, remote=True)
    with open_cache(settings, write=args.fix) as cache:
        if args.fix:
            refuse_read_only(maintenance.persistent(cache.tiers), "verify --fix removed nothing")
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
    require_cache(settings, remote=args.remote)
    with open_cache(settings, write=not args.dry_run) as cache:
        chosen = targets(cache.tiers, remote=args.remote)
        if not args.dry_run:
            refuse_read_only(chosen, "prune removed nothing (--dry-run shows what it would)")
        names = {id(t): n for n, t in named(cache.tiers)}
        report: dict[str, Any] = {"dry_run": args.dry_run, "tiers": {}}
        for tier in chosen:
            progress = Progress("prune", 0)
            result = maintenance.prune(
                tier,
                max_bytes=args.max_size,
                max_entries=args.max_entries,
                older_than=args.older_than,
                progress=progress.set,
                dry_run=args.dry_run,
            )
            progress.close()
            if not args.dry_run:
                tier.sweep()
            report["tiers"][names[id(tier)]] = dataclasses.asdict(result)
        for field in ("removed", "freed", "kept", "kept_bytes"):
            report[field] = sum(t[field] for t in report["tiers"].values())
        if report["removed"] and not args.dry_run:
            _forget_keys(cache, {i.key for _t, i in maintenance.entries(cache.tiers)})
    if args.json:
        print_json(report)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    left = "would remain" if args.dry_run else "remain"
    print(
        f"{verb} {report['removed']} entries ({format_size(report['freed'])}); "
        f"{report['kept']} entries ({format_size(report['kept_bytes'])}) {left} "
        f"in {', '.join(report['tiers']) or 'no tier'}"
    )
    return 0


def cmd_clear(args: argparse.Namespace, settings: Settings) -> int:
    require_cache(settings, remote=args.remote)
    with open_cache(settings, write=False) as cache:
        chosen = targets(cache.tiers, remote=args.remote)
        count = sum(1 for _ in maintenance.entries(chosen))
        chosen_names = [n for n, t in named(cache.tiers) if t in chosen]
        where = ", ".join(f"{n} {t!r}" for n, t in named(cache.tiers) if t in chosen)
    if settings.read_only:  # opened read-only above to look; a write would be refused
        with open_cache(settings, write=True) as cache:
            refuse_read_only(targets(cache.tiers, remote=args.remote), "clear removed nothing")
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"refusing to clear {where} without --yes (no terminal)")
        answer = input(f"Remove all {count} entries from {where}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    removed = 0
    if count:  # else create nothing where there was no cache
        with open_cache(settings, write=True) as cache:
            chosen = targets(cache.tiers, remote=args.remote)
            refuse_read_only(chosen, "clear removed nothing")
            for tier in chosen:
                removed += tier.clear()
                tier.sweep()
            kept = [t for t in maintenance.persistent(cache.tiers) if t not in chosen]
            _forget_keys(cache, {i.key for _t, i in maintenance.entries(kept)} if kept else None)
    if args.json:
        print_json({"removed": removed, "tiers": chosen_names})
    else:
        print(f"removed {removed} entries from {where}")
    return 0


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    require_cache(settings, remote=True)
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
    if args.json:
        report = {"exported": writer.count, "bytes": writer.bytes, "damaged": damaged}
        print_json({**report, "file": args.file})
        return 0
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
            refuse_read_only(maintenance.persistent(cache.tiers), "import added nothing")
            raise ConfigError("no tier to import into")
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
    if args.json:
        print_json(
            {
                "file": args.file,
                "added": result.added,
                "present": result.present,
                "conflicts": result.conflicts,
            }
        )
        return 0
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
