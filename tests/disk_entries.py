"""What a disk tier holds, whatever its layout: entry files and packed records (issue 40).

Tests that counted or damaged ``v1/entries/*/*.kce`` files go through these, as
small entries now live in per-shard packs (stores/disk/pack.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path

from kernelcache.stores.disk import DiskStore


def stored_keys(root: str | os.PathLike[str]) -> list[str]:
    """The keys the disk tier at ``root`` holds (none if there is no tier there)."""
    if not (Path(root) / "v1").exists():
        return []
    store = DiskStore(root, read_only=True)
    try:
        return [info.key for info in store.scan()]
    finally:
        store.close()


def damage_every_entry(
    root: str | os.PathLike[str],
    change: Callable[[bytes], bytes],
    keys: Collection[str] | None = None,
) -> int:
    """Replace each entry's stored bytes (of ``keys`` only, if given) by ``change`` of
    them, in place (a file, or a packed record of the same length); how many were damaged."""
    store = DiskStore(root, read_only=True)
    damaged = 0
    try:
        for info in store.scan():
            if keys is not None and info.key not in keys:
                continue
            if not info.extra.get("packed"):
                path = Path(info.extra["path"])
                path.chmod(0o600)
                path.write_bytes(change(path.read_bytes()))
            else:
                (data,) = Path(info.extra["path"]).parent.glob(
                    Path(info.extra["path"]).stem + ".*.dat"
                )
                start, size = info.extra["record"], info.size - info.extra["extracted"]
                raw = data.read_bytes()
                new = change(raw[start : start + size])
                assert len(new) == size, "a packed record is damaged in place"
                data.write_bytes(raw[:start] + new + raw[start + size :])
            damaged += 1
    finally:
        store.close()
    return damaged
