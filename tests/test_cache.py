"""Cache: read-through, promotion, writes to writable tiers, failures as counted misses."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import weakref
from pathlib import Path

import pytest

from kernelcache import Cache, DiskStore, Entry, KeyBuilder, MemoryStore, Settings

KEY = KeyBuilder("test").add("k", 1).hexdigest()
ENTRY = Entry({"kernel.cubin": b"\x7fELF" + os.urandom(4000)}, {"name": "k"})


def test_hit_in_lower_tier_is_promoted(tmp_path: Path) -> None:
    DiskStore(tmp_path).put(KEY, ENTRY)
    memory = MemoryStore()
    cache = Cache([memory, DiskStore(tmp_path)])
    assert cache.get(KEY) == ENTRY
    assert memory.get(KEY) == ENTRY
    stats = cache.stats()
    assert stats["memory"]["misses"] == 1
    assert stats["memory"]["puts"] == 1
    assert stats["disk"]["hits"] == 1
    assert cache.get(KEY) is memory.get(KEY)  # served by reference from memory now


def test_put_writes_every_writable_tier_and_skips_read_only(tmp_path: Path) -> None:
    DiskStore(tmp_path / "ro")  # create the layout so a read-only store can open it
    memory, disk, ro = (
        MemoryStore(),
        DiskStore(tmp_path / "rw"),
        DiskStore(tmp_path / "ro", read_only=True),
    )
    cache = Cache([memory, disk, ro])
    cache.put(KEY, ENTRY)
    assert memory.get(KEY) == ENTRY
    assert disk.get(KEY) == ENTRY
    assert ro.get(KEY) is None
    assert cache.delete(KEY)
    assert cache.get(KEY) is None


def test_read_only_tier_still_serves_and_is_not_written_by_promotion(tmp_path: Path) -> None:
    DiskStore(tmp_path).put(KEY, ENTRY)
    first = DiskStore(tmp_path / "empty")
    cache = Cache([MemoryStore(read_only=True), first, DiskStore(tmp_path, read_only=True)])
    assert cache.get(KEY) == ENTRY
    assert first.get(KEY) == ENTRY
    assert cache.tiers[0].usage() == (0, 0)


def test_broken_disk_tier_is_a_miss_and_a_counter(tmp_path: Path) -> None:
    broken = DiskStore(tmp_path / "broken")
    good = DiskStore(tmp_path / "good")
    good.put(KEY, ENTRY)
    broken.pack_max = 0  # entries as files, none packed: the fault below reaches them all
    # A real fault: the tier's entry directories are replaced by a file (ENOTDIR on every access).
    entries = tmp_path / "broken" / "v1" / "entries"
    shutil.rmtree(entries)
    entries.write_bytes(b"not a directory")
    cache = Cache([broken, good])
    assert cache.get(KEY) == ENTRY  # served by the next tier, promotion failure swallowed
    cache.put(KEY, ENTRY)
    stats = cache.stats()
    assert stats["disk"]["errors"] >= 2
    assert stats["disk2"]["hits"] == 1


def test_disk_full_on_put_is_counted_and_others_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskStore(tmp_path)
    memory = MemoryStore()

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # the disk tier's rename into place
    cache = Cache([disk, memory])
    cache.put(KEY, ENTRY)
    assert memory.get(KEY) == ENTRY
    assert disk.counters.errors == 1
    assert os.listdir(tmp_path / "v1" / "staging") == []  # no litter
    monkeypatch.undo()
    assert disk.get(KEY) is None


def test_invalid_keys_and_values_are_caller_errors(tmp_path: Path) -> None:
    cache = Cache([MemoryStore(), DiskStore(tmp_path)])
    for bad in ("", "../x", "a/b", ".hidden", "x" * 201, 5):
        with pytest.raises(ValueError, match="invalid cache key"):
            cache.get(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Entry"):
        cache.put(KEY, b"raw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Store"):
        Cache([object()])  # type: ignore[list-item]


def test_get_or_compile_compiles_once_and_records_duration(tmp_path: Path) -> None:
    calls: list[int] = []

    def compile_() -> bytes:
        calls.append(1)
        return b"binary"

    cache = Cache([MemoryStore(), DiskStore(tmp_path)])
    first = cache.get_or_compile(KEY, compile_)
    again = Cache([DiskStore(tmp_path)]).get_or_compile(KEY, compile_)
    assert calls == [1]
    assert first["data"] == again["data"] == b"binary"
    assert again.meta["compile_seconds"] >= 0


def test_default_cache_honours_settings(tmp_path: Path) -> None:
    settings = Settings.load(
        environ={"KERNELCACHE_DIR": str(tmp_path), "KERNELCACHE_MAX_SIZE": "1G"}
    )
    cache = Cache(settings=settings)
    assert [t.kind for t in cache.tiers] == ["memory", "disk"]
    disk = cache.tiers[1]
    assert isinstance(disk, DiskStore)
    assert disk.path == str(tmp_path)
    assert disk.max_bytes == 1 << 30
    disabled = Cache(settings=Settings.load(environ={"KERNELCACHE_DISABLE": "1"}))
    assert disabled.tiers == []
    assert disabled.get(KEY) is None
    assert disabled.get_or_compile(KEY, lambda: b"x")["data"] == b"x"


def test_put_entry_paths_lie_in_the_disk_tier_and_survive_its_failure(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path / "disk")
    cache = Cache([MemoryStore(), disk])
    entry = Entry({"kernel.cubin": b"\x7fELF" + b"2" * 64})
    cache.put(KEY, entry)
    path = Path(cache.get(KEY).path("kernel.cubin"))  # type: ignore[union-attr]
    assert path.is_relative_to(tmp_path / "disk")
    assert path.read_bytes() == entry["kernel.cubin"]
    # The tier's extraction area breaks (ENOTDIR): a verified private copy still serves loaders.
    other = Entry({"kernel.cubin": b"\x7fELF" + b"3" * 64})
    stored = cache.put(KEY, other)
    assert other.key is None  # the caller's entry is never modified; put returns the bound one
    files = tmp_path / "disk" / "v1" / "extracted"
    shutil.rmtree(files)
    files.write_bytes(b"")
    fallback = Path(stored.path("kernel.cubin"))
    assert not fallback.is_relative_to(tmp_path)
    assert fallback.read_bytes() == other["kernel.cubin"]
    assert disk.counters.errors >= 1


def test_a_dropped_cache_is_freed_at_once_not_by_the_cyclic_collector(tmp_path: Path) -> None:
    """No reference cycle through the Cache: its last statistics flush runs when the last
    reference goes, not at some later allocation (possibly inside another flush)."""
    gc.disable()
    try:
        cache = Cache([MemoryStore(), DiskStore(tmp_path / "d")])
        cache.put(KEY, Entry({"a": b"x"}))
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
    finally:
        gc.enable()
