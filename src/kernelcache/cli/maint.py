"""The CLI's maintenance commands: verify, prune, clear, export, import.

Every removal goes through :meth:`DiskStore.remove_if_unchanged`, so an entry
another process publishes while a command runs is never removed by mistake.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

from kernelcache import bundle
from kernelcache.cli.output import Progress, print_json
from kernelcache.entry import Entry
from kernelcache.errors import ConfigError, CorruptEntry
from kernelcache.settings import Settings
from kernelcache.stats import totals as stats_file
from kernelcache.stores.base import EntryInfo
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.lockfile import sweep_locks
from kernelcache.units import format_size


def _check(info: EntryInfo) -> tuple[str | None, EntryInfo]:
    """Verify one entry file: ``(reason it is bad or None, info of the file read)``."""
    try:
        with open(info.extra["path"], "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except FileNotFoundError:
        return None, info  # removed meanwhile: nothing to check
    # Remove only the very file that was checked, not one published since.
    checked = EntryInfo(info.key, st.st_size, st.st_mtime, st.st_ctime, {"ino": st.st_ino})
    try:
        Entry.unpack(data, info.key)
    except CorruptEntry as exc:
        return str(exc), checked
    return None, checked


def cmd_verify(args: argparse.Namespace, settings: Settings) -> int:
    store = DiskStore(settings.dir, read_only=settings.readonly or not args.fix)
    infos = list(store.scan())
    progress = Progress("verify", len(infos))
    bad: list[dict[str, Any]] = []
    for done, info in enumerate(infos, 1):
        reason, checked = _check(info)
        if reason is not None:
            removed = store.remove_if_unchanged(checked) if args.fix else False
            bad.append({"key": info.key, "error": reason, "removed": removed})
        progress.update(done)
    progress.close()
    if args.fix and bad:
        stats_file.forget_keys(settings.dir, {i.key for i in infos} - {b["key"] for b in bad})
    if args.json:
        print_json({"checked": len(infos), "bad": bad})
    else:
        for item in bad:
            action = "removed" if item["removed"] else "damaged"
            print(f"{action}: {item['key']}: {item['error']}")
        print(f"checked {len(infos)} entries: {len(infos) - len(bad)} ok, {len(bad)} damaged")
    return 0 if all(item["removed"] for item in bad) else 1


def cmd_prune(args: argparse.Namespace, settings: Settings) -> int:
    if args.max_size is None and args.max_entries is None and args.older_than is None:
        raise ConfigError("prune needs at least one of --max-size, --max-entries, --older-than")
    store = DiskStore(settings.dir, read_only=settings.readonly)
    infos = sorted(store.scan(), key=lambda i: i.last_access)  # least recently used first
    now = time.time()
    total = sum(i.size for i in infos)
    victims = []
    for position, info in enumerate(infos):
        left = len(infos) - position
        if not (
            (args.older_than is not None and now - info.last_access > args.older_than)
            or (args.max_size is not None and total > args.max_size)
            or (args.max_entries is not None and left > args.max_entries)
        ):
            break  # the rest are newer and the limits hold
        victims.append(info)
        total -= info.size
    progress = Progress("prune", len(victims))
    removed = freed = 0
    for done, info in enumerate(victims, 1):
        if store.remove_if_unchanged(info):
            removed, freed = removed + 1, freed + info.size
        progress.update(done)
    progress.close()
    if removed:
        stats_file.forget_keys(settings.dir, {i.key for i in infos[len(victims) :]})
    sweep_locks(store.locks_dir)
    kept = len(infos) - removed
    print(
        f"removed {removed} entries ({format_size(freed)}); "
        f"{kept} entries ({format_size(sum(i.size for i in infos) - freed)}) remain"
    )
    return 0


def cmd_clear(args: argparse.Namespace, settings: Settings) -> int:
    store = DiskStore(settings.dir, read_only=True)
    count = sum(1 for _ in store.scan())
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"refusing to clear {settings.dir} without --yes (no terminal)")
        answer = input(f"Remove all {count} entries from {settings.dir}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    if not os.path.isdir(os.path.join(settings.dir, "v1")):
        print("removed 0 entries")
        return 0
    store = DiskStore(settings.dir, read_only=settings.readonly)
    removed = store.clear()
    stats_file.forget_keys(settings.dir)
    sweep_locks(store.locks_dir)
    print(f"removed {removed} entries from {settings.dir}")
    return 0


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    store = DiskStore(settings.dir, read_only=True)
    cutoff = time.time() - args.since if args.since is not None else None
    infos = [i for i in store.scan() if cutoff is None or i.last_access >= cutoff]
    progress = Progress("export", len(infos))
    damaged = 0
    # Written beside the target and renamed into place: never a partial bundle.
    tmp = f"{args.file}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            writer = bundle.BundleWriter(f)
            for done, info in enumerate(infos, 1):
                entry = store.get(info.key)
                if entry is not None:
                    writer.add(entry, info.key)
                elif store.info(info.key) is not None:
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


def cmd_import(args: argparse.Namespace, settings: Settings) -> int:
    try:
        count, _size = bundle.verify(args.file)
    except bundle.BundleError as exc:
        print(f"kernelcache: error: {args.file}: {exc}; nothing imported", file=sys.stderr)
        return 1
    store = DiskStore(settings.dir, read_only=settings.readonly)
    progress = Progress("import", count)
    added = present = 0
    for done, entry in enumerate(bundle.entries(args.file), 1):
        key = entry.key or ""
        if store.get(key) is not None:
            present += 1  # same key, same content: keep the one already stored
        else:
            store.put(key, entry)
            added += 1
        progress.update(done)
    progress.close()
    print(f"imported {added} entries from {args.file} ({present} were already present)")
    return 0
