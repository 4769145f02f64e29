"""What a disk tier holds, whatever its layout: entry files and packed records (issue 40).

Tests that counted or damaged ``v1/entries/*/*.kce`` files go through these, as
small entries now live in per-shard packs (stores/disk/pack.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pytest

from kernelcache import Entry
from kernelcache.stores.disk import DiskStore, shard_of
from kernelcache.stores.disk.packindex import generation


def in_shard(shard: str, count: int, prefix: str) -> list[str]:
    """``count`` keys starting with ``prefix`` that fall in ``shard``."""
    keys: list[str] = []
    i = 0
    while len(keys) < count:
        key = f"{prefix}{i:06d}"
        if shard_of(key) == shard:
            keys.append(key)
        i += 1
    return keys


def value(key: str, size: int = 4000) -> bytes:
    """``size`` bytes made of ``key``: each key's entry differs, and reads back as itself."""
    return (key.encode() * (size // len(key) + 1))[:size]


def entry(key: str, size: int = 4000) -> Entry:
    """An entry of :func:`value` (packed when small: 16 KB or less)."""
    return Entry({"data": value(key, size)})


def packs(store: DiskStore) -> Path:
    """The folder of ``store``'s packs (``v1/packs``)."""
    return Path(store.layout.base) / "packs"


def data_file(store: DiskStore, shard: str) -> Path:
    """The data file that ``shard``'s index names now. Found by the index's generation,
    not by a glob: a compaction killed before its sweep leaves another generation's file
    beside it (until the shard's next writer removes it)."""
    with (
        (packs(store) / f"{shard}.idx").open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
    ):
        gen = generation(mm)
    assert gen is not None, f"shard {shard}'s index is not an index"
    return packs(store) / f"{shard}.{gen}.dat"


def flip_packed_byte(store: DiskStore, key: str, at: int) -> None:
    """Flip the byte ``at`` bytes into ``key``'s packed record, in its shard's data file."""
    info = store.info(key)
    assert info is not None
    assert info.extra.get("packed")
    data = data_file(store, shard_of(key))
    raw = bytearray(data.read_bytes())
    raw[info.extra["record"] + at] ^= 0xFF
    data.write_bytes(bytes(raw))


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only for this process: a read-only bind mount as root, else chmod."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in (path, *path.rglob("*")) if p.is_dir()}
        for p in modes:
            p.chmod(0o500)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mount = ["mount", "--bind", str(path), str(path)]
    if shutil.which("mount") is None or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot make a read-only mount here")
    try:
        remount = ["mount", "-o", "remount,ro,bind", str(path)]
        subprocess.run(remount, check=True, capture_output=True)
        yield
    finally:
        # Lazily: a store a failing test left open must not leave the mount behind.
        subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True)


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
                data = data_file(store, shard_of(info.key))
                start, size = info.extra["record"], info.size - info.extra["extracted"]
                raw = data.read_bytes()
                new = change(raw[start : start + size])
                assert len(new) == size, "a packed record is damaged in place"
                data.write_bytes(raw[:start] + new + raw[start + size :])
            damaged += 1
    finally:
        store.close()
    return damaged
