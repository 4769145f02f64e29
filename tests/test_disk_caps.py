"""Size caps that keep what they promise (issue 10): whole-tier LRU, big entries kept,
a filled tier near its cap, extracted copies counted once, lost counters bounded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from kernelcache import Cache, Entry, Settings
from kernelcache.stores.disk import LOW_WATER, DiskStore, shard_of
from kernelcache.stores.disk import space as space_module
from kernelcache.stores.disk.layout import Found, Layout, scan_shard

CAP = 1 << 20


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about entry files (damaged, linked, aged, counted): small entries go
    into files here, as before packing. Packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def on_disk(root: Path) -> int:
    """Bytes of entry files and extracted copies, counted from the files themselves."""
    total = 0
    for part in ("entries", "extracted"):
        for dirpath, _dirs, names in os.walk(root / "v1" / part):
            total += sum(os.lstat(os.path.join(dirpath, n)).st_size for n in names)
    return total


def blob(i: int, size: int) -> Entry:
    return Entry({"kernel.cubin": i.to_bytes(8, "little") + bytes(size - 8)})


def entry_file(store: DiskStore, key: str) -> Path:
    (path,) = Path(store.path).glob(f"v1/entries/*/{key}.kce")
    return path


def set_age(store: DiskStore, key: str, seconds_ago: float) -> None:
    then = time.time() - seconds_ago
    os.utime(entry_file(store, key), (then, then))


@pytest.mark.parametrize("fraction", [16, 8, 5, 4])
@pytest.mark.parametrize("extract", [False, True], ids=["put", "put+path"])
def test_an_entry_up_to_a_quarter_of_the_cap_survives_its_own_put(
    tmp_path: Path, fraction: int, extract: bool
) -> None:
    """Today's shard shares evicted anything over ~0.9 x cap/16 at once."""
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(3 * fraction):  # the tier fills and turns over three times
        key = f"k{i}"
        stored = store.put(key, blob(i, CAP // fraction - 200))
        got = store.get(key)
        assert got is not None, f"put {i} evicted its own entry"
        if extract:
            path = Path(stored.path("kernel.cubin"))
            assert path.read_bytes() == got["kernel.cubin"]
            assert path.is_relative_to(store.path) or fraction == 4
    assert store.counters.evictions > 0
    assert on_disk(Path(store.path)) <= CAP


def test_eviction_takes_the_least_recently_used_of_the_whole_tier(tmp_path: Path) -> None:
    """Old entries in one shard go before recently used ones in another, whatever
    shard the put that runs over the cap lands in."""
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    keys = [f"k{i}" for i in range(12)]
    size = CAP // 13
    for i, key in enumerate(keys):
        store.put(key, blob(i, size))
        set_age(store, key, 1000 - i)  # k0 least recently used ... k11 most
    by_shard = {shard_of(k) for k in keys}
    assert len(by_shard) > 2  # spread over several shards
    for i in range(4):
        store.put(f"new{i}", blob(100 + i, size))
    left = {k for k in keys if store.get(k) is not None}
    evicted = [k for k in keys if k not in left]
    assert evicted, "the cap evicted nothing"
    assert evicted == keys[: len(evicted)], evicted  # oldest first, across shards
    assert all(store.get(f"new{i}") is not None for i in range(4))


@pytest.mark.parametrize(
    "size",
    [1 << 10, 4 << 10, 16 << 10, 64 << 10, CAP // 16, CAP // 8],
    ids=["1KiB", "4KiB", "16KiB", "64KiB", "cap/16", "cap/8"],
)
def test_a_filled_tier_holds_at_least_80_percent_of_its_cap(tmp_path: Path, size: int) -> None:
    root = tmp_path / "c"
    store = DiskStore(root, max_bytes=CAP)
    puts = 3 * CAP // size
    shares = []
    for i in range(puts):
        store.put(f"k{i:05d}", blob(i, size))
        if i > puts // 3 and i % max(1, puts // 30) == 0:
            shares.append(on_disk(root) / CAP)
    assert min(shares) >= 0.8, shares
    assert max(shares) <= 1.0, shares
    assert store.usage()[1] == on_disk(root)


def test_no_put_scans_the_whole_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction at the cap rescans one shard when its LRU queue runs out, not the tier."""
    store = DiskStore(tmp_path / "c")
    for i in range(1500):
        store.put(f"k{i:05d}", blob(i, 1000))
    store.max_bytes = store.usage()[1]  # full: from here on every put evicts
    scans: list[str] = []

    def counted_scan(
        layout: Layout, shard: str, packed: Iterable[Found] = ()
    ) -> tuple[list[Found], list[str]]:
        scans.append(shard)
        return scan_shard(layout, shard, packed)

    monkeypatch.setattr(space_module, "scan_shard", counted_scan)
    for i in range(300):  # at the cap: every put evicts
        store.put(f"n{i:05d}", blob(i, 1000))
    assert store.counters.evictions >= 250
    # Each of the 16 shards is scanned about once per turnover of its ~94 entries.
    assert len(scans) <= 16 + 300 // 40, scans


def test_entry_path_on_a_capped_tier_is_a_file_with_the_bytes(tmp_path: Path) -> None:
    """The copy's bytes count too; extracting must not evict the entry (or its copy)."""
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(10):
        stored = store.put(f"k{i}", blob(i, CAP // 3))
        path = Path(stored.path("kernel.cubin"))
        assert path.read_bytes() == stored["kernel.cubin"]
        again = store.get(f"k{i}")
        assert again is not None
        assert Path(again.path("kernel.cubin")) == path
    assert on_disk(Path(store.path)) <= CAP


def test_extracted_copies_are_counted_once_and_do_not_pile_up(tmp_path: Path) -> None:
    """Each version of a key got its own folder, all counted, none removed until the
    key was evicted; now a new version's copies replace the old ones."""
    store = DiskStore(tmp_path / "c")
    for version in range(5):
        store.put("k", blob(version, 50_000))
        for _ in range(2):
            got = store.get("k")
            assert got is not None
            Path(got.path("kernel.cubin")).read_bytes()
    entry_bytes = entry_file(store, "k").stat().st_size
    assert store.usage() == (1, entry_bytes + 50_000) == (1, on_disk(Path(store.path)))


def test_losing_the_counter_cannot_let_the_tier_outgrow_its_cap(tmp_path: Path) -> None:
    """Each put from a new process (the launcher's way), after the counters were deleted."""
    root = tmp_path / "c"
    for i in range(200):
        with DiskStore(root, max_bytes=256 << 10) as store:
            store.put(f"k{i}", blob(i, 8 << 10))
        for counter in (root / "v1" / "space", *(root / "v1" / "shards").glob("*")):
            counter.unlink(missing_ok=True)  # the tier's counter (and older per-shard ones)
        assert on_disk(root) <= (256 << 10) + (9 << 10)  # the cap plus the entry in flight


def test_an_entry_larger_than_the_cap_is_refused_without_evicting_others(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(4):
        store.put(f"k{i}", blob(i, CAP // 8))
    stored = store.put("huge", blob(9, CAP))
    assert store.get("huge") is None
    assert store.counters.evictions == 1
    assert all(store.get(f"k{i}") is not None for i in range(4))
    assert Path(stored.path("kernel.cubin")).read_bytes() == stored["kernel.cubin"]  # private


def test_entry_cap_is_for_the_whole_tier(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_entries=10)
    for i in range(40):
        store.put(f"k{i}", blob(i, 100))
    assert set(store.keys()) == {f"k{i}" for i in range(30, 40)}
    assert store.usage()[0] == 10


def test_cleaning_stops_at_the_low_water_mark(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(300):
        store.put(f"k{i}", blob(i, 10_000))
    assert LOW_WATER * CAP - 11_000 <= store.usage()[1] <= CAP


def test_damaged_lru_queues_only_cost_a_rescan(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(150):
        store.put(f"k{i}", blob(i, 10_000))
    for queue in Path(store.layout.lru).iterdir():
        queue.write_bytes(os.urandom(50))
    for i in range(150, 200):
        store.put(f"k{i}", blob(i, 10_000))
    assert store.get("k199") is not None
    assert store.get("k0") is None
    assert store.usage()[1] == on_disk(Path(store.path)) <= CAP


def test_read_only_settings_write_nothing_into_the_directory(tmp_path: Path) -> None:
    """Hits, Entry.path() and statistics of a read-only Cache leave the directory as it was."""
    root = tmp_path / "shared"
    with Cache(settings=Settings.load(dir=str(root))) as writer:
        writer.put("k" * 16, blob(1, 5000))
        writer.put("j" * 16, blob(2, 5000))
    before = snapshot(root)
    then = time.time() - 3600  # old enough that a hit would refresh the LRU clock
    for entry_file in root.glob("v1/entries/*/*.kce"):
        os.utime(entry_file, (then, then))
    before = snapshot(root)
    settings = Settings.load(dir=str(root), read_only=True, max_bytes="64K")
    with Cache(settings=settings) as reader:
        got = reader.get("k" * 16)
        assert got is not None
        path = Path(got.path("kernel.cubin"))
        assert path.read_bytes() == got["kernel.cubin"]
        assert not path.is_relative_to(root)  # a private copy
        reader.get_or_compile("x" * 16, lambda: b"compiled")
        reader.flush_stats()
    assert snapshot(root) == before


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime (ns)."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_forged_lru_record_never_names_a_path_outside_the_shard(tmp_path: Path) -> None:
    import struct

    victim = tmp_path / "victim.kce"
    victim.write_bytes(b"precious")
    store = DiskStore(tmp_path / "c", max_bytes=CAP)
    for i in range(100):
        store.put(f"k{i}", blob(i, 10_000))
    st = victim.stat()
    forged = b"../../../../victim"
    record = struct.pack("<qQB", st.st_mtime_ns - 10**9, st.st_ino, len(forged)) + forged
    for queue in Path(store.layout.lru).iterdir():
        head = struct.pack("<8sqQ", b"KCLRU\x00\x00\x01", time.time_ns(), 24)
        queue.write_bytes(head + record)
    for i in range(100, 150):
        store.put(f"k{i}", blob(i, 10_000))
    assert victim.read_bytes() == b"precious"
    assert store.usage()[1] <= CAP


def test_a_read_only_launcher_starts_no_server_in_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's server keeps its socket, lock and log in the cache directory."""
    from kernelcache.nvcc import client

    root = tmp_path / "shared"
    DiskStore(root).put("k", blob(1, 100))
    before = snapshot(root)
    monkeypatch.setenv("KERNELCACHE_DIR", str(root))
    monkeypatch.setenv("KERNELCACHE_READONLY", "1")
    monkeypatch.delenv("KERNELCACHE_SERVER", raising=False)
    ran: list[list[str]] = []

    def local(argv: list[str]) -> int:
        ran.append(argv)
        return 0

    rc = client.serve(["nvcc", "--version"], local, lambda n, a: 1)
    assert rc == 0
    assert ran == [["nvcc", "--version"]]  # in-process, no server asked
    assert snapshot(root) == before
