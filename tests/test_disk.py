"""DiskStore behaviour that only a directory of files has (the shared contract is elsewhere)."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kernelcache import Cache, Entry, StoreError
from kernelcache.stores import disk
from kernelcache.stores.disk import DiskStore, shard_of
from kernelcache.stores.disk.files import Extractor


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about entry files (damaged, linked, aged, counted): small entries go
    into files here, as before packing. Packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def entry_of(tag: str, size: int = 2000) -> Entry:
    return Entry({"kernel.cubin": tag.encode().ljust(size, b"#"), "log": b"ok"}, meta={"t": tag})


def entry_file(store: DiskStore, key: str) -> Path:
    return Path(store.layout.entry_path(key))


def keys_in_shard(shard: str, count: int, prefix: str = "k") -> list[str]:
    keys: list[str] = []
    i = 0
    while len(keys) < count:
        if shard_of(f"{prefix}{i}") == shard:
            keys.append(f"{prefix}{i}")
        i += 1
    return keys


def staging_items(store: DiskStore) -> list[str]:
    return os.listdir(store.layout.staging)


def test_directory_is_private(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "new" / "cache")
    store.put("k", entry_of("x"))
    layout = store.layout
    shard = f"{layout.entries}/{shard_of('k')}"
    for path in (store.path, layout.base, layout.entries, shard, layout.staging, layout.lru):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    assert stat.S_IMODE(os.stat(layout.space).st_mode) == 0o600
    assert stat.S_IMODE(entry_file(store, "k").stat().st_mode) == 0o600


def test_get_never_leaves_the_directory(tmp_path: Path) -> None:
    """A key is a file name: "../" in one must not reach (or remove) a file outside."""
    store = DiskStore(tmp_path / "store")
    victim = tmp_path / "victim.kce"
    victim.write_bytes(b"not an entry")
    with pytest.raises(ValueError, match="invalid cache key"):
        store.get("../../../../victim")
    assert victim.read_bytes() == b"not an entry"
    assert store.counters.corrupt == 0


def plant_foreign_files(store: DiskStore) -> dict[Path, bytes]:
    """Files a user or another tool left in the cache directory, each in a place the
    store scans: top level, shard directories, extraction directories."""
    own_shard_key = keys_in_shard("3", 1, prefix="dirkey")[0]
    foreign = {
        Path(store.path, "notes.txt"): b"top",
        Path(store.layout.entries, "3", "README"): b"readme",
        Path(store.layout.entries, "3", "bad name.kce"): b"bad key name",
        Path(store.layout.entries, "3", ".hidden.kce"): b"hidden",
        Path(store.layout.entries, "3", f"{own_shard_key}.kce", "inside"): b"dir named like one",
        Path(store.layout.extracted, "3", "notes.txt"): b"file in extracted/",
        Path(store.layout.extracted, "3", "bad name", "x"): b"a folder of no key",
        Path(store.layout.extracted, "3", "loose"): b"no dot",
    }
    for path, data in foreign.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return foreign


def test_foreign_files_are_ignored(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_entries=2)
    foreign = plant_foreign_files(store)
    keys = keys_in_shard("3", 12)
    for key in keys:  # each put past two cleans the tier (and scans shard 3)
        store.put(key, entry_of(key))
        got = store.get(key)
        assert got is not None
        got.path("kernel.cubin")  # extraction directories next to the foreign files
    assert set(store.keys()) <= set(keys)
    assert {info.key for info in store.scan()} == set(store.keys())
    assert store.usage()[0] == len(list(store.keys())) <= 2
    assert store.counters.errors == 0
    store.clear()
    assert list(store.keys()) == []
    for path, data in foreign.items():
        assert path.read_bytes() == data, path
    reopened = DiskStore(store.path)
    assert list(reopened.keys()) == []


def test_extracted_files_of_dotted_keys_are_separate(tmp_path: Path) -> None:
    """Removing key "a" must not remove the files extracted for key "a.b"."""
    store = DiskStore(tmp_path / "c")
    short = next(f"a{i}" for i in range(1000) if shard_of(f"a{i}") == shard_of(f"a{i}.b"))
    for key in (short, f"{short}.b"):
        store.put(key, entry_of(key))
    got = store.get(f"{short}.b")
    assert got is not None
    path = got.path("kernel.cubin")
    assert store.delete(short)
    assert Path(path).read_bytes() == got["kernel.cubin"]


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_header(data: bytes) -> bytes:
    return data[:20] + bytes([data[20] ^ 0x01]) + data[21:]


def _flip_data(data: bytes) -> bytes:
    return data[:-10] + bytes([data[-10] ^ 0x80]) + data[-9:]


def _foreign(data: bytes) -> bytes:
    return b"\x7fELF" + os.urandom(len(data))


def _empty(data: bytes) -> bytes:
    return b""


def _appended(data: bytes) -> bytes:
    return data + b"trailing"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_truncate, id="truncated"),
        pytest.param(_flip_header, id="bit-flip-header"),
        pytest.param(_flip_data, id="bit-flip-data"),
        pytest.param(_foreign, id="foreign-bytes"),
        pytest.param(_empty, id="empty"),
        pytest.param(_appended, id="trailing-bytes"),
    ],
)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-hit"])
def test_corrupt_entry_is_a_counted_miss_and_removed(
    tmp_path: Path, damage: Any, warm: bool
) -> None:
    """After a hit too: a hit that skips the fstat (recent mtime known) still verifies."""
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    store.put("other", entry_of("other"))
    if warm:
        assert store.get("k") == entry_of("k")
        store.counters.hits = 0
    path = entry_file(store, "k")
    path.write_bytes(damage(path.read_bytes()))
    assert store.get("k") is None
    assert (store.counters.corrupt, store.counters.misses, store.counters.errors) == (1, 1, 0)
    assert not path.exists()
    assert store.usage()[0] == 1
    assert store.get("other") == entry_of("other")
    store.put("k", entry_of("k"))  # the key is usable again
    assert store.get("k") == entry_of("k")


def test_a_directory_in_place_of_a_known_entry_is_corrupt_and_removed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    assert store.get("k") == entry_of("k")  # its mtime is now known: the next hit skips fstat
    path = entry_file(store, "k")
    path.unlink()
    path.mkdir()
    assert store.get("k") is None
    assert (store.counters.corrupt, store.counters.errors) == (1, 0)
    assert not path.exists()


def test_a_hit_touches_an_old_entry_once_per_interval(tmp_path: Path) -> None:
    """The LRU clock: a hit of an entry older than TOUCH_INTERVAL refreshes its mtime;
    hits of a recent one write nothing, in this process and in another."""
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    path = entry_file(store, "k")
    old = time.time() - 2 * disk.store.TOUCH_INTERVAL
    os.utime(path, (old, old))
    assert store.get("k") == entry_of("k")
    touched = path.stat().st_mtime_ns
    assert touched > old * 1e9 + disk.store.TOUCH_INTERVAL * 1e9
    for reader in (store, DiskStore(store.path)):
        for _ in range(3):
            assert reader.get("k") == entry_of("k")
    assert path.stat().st_mtime_ns == touched
    assert store.counters.hits == 4


def _reading_updates_atime(folder: Path) -> bool:
    """Whether this mount writes atime on a plain read of a file whose atime is older than
    its mtime (relatime and strictatime do; noatime never does)."""
    probe = folder / "atime-probe"
    probe.write_bytes(b"x")
    before = probe.stat().st_mtime_ns - 10**10
    os.utime(probe, ns=(before, probe.stat().st_mtime_ns))
    probe.read_bytes()
    updated = probe.stat().st_atime_ns != before
    probe.unlink()
    return updated


def test_a_hit_leaves_the_entry_files_atime_alone(tmp_path: Path) -> None:
    """Hits open entries with O_NOATIME (issue 40): under relatime, the first read of a
    file written or touched since its last read would write its atime, an inode update
    on every distinct-key hit. Nothing in the tier uses atime."""
    if not _reading_updates_atime(tmp_path):
        pytest.skip("this mount never writes atime on reads (noatime)")
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    path = entry_file(store, "k")
    mtime = path.stat().st_mtime_ns
    atime = mtime - 10**10
    os.utime(path, ns=(atime, mtime))
    for reader in (store, DiskStore(store.path)):  # the fstat path, and the known-recent one
        assert reader.get("k") == entry_of("k")
        assert reader.get("k") == entry_of("k")
    assert path.stat().st_atime_ns == atime
    assert path.stat().st_mtime_ns == mtime
    assert store.counters.hits == 2


def test_entry_under_the_wrong_name_is_corrupt(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("a", entry_of("a"))
    store.put("b", entry_of("b"))
    entry_file(store, "b").write_bytes(entry_file(store, "a").read_bytes())
    assert store.get("b") is None
    assert store.counters.corrupt == 1


def test_read_only_store_counts_corruption_but_removes_nothing(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    path = entry_file(store, "k")
    path.write_bytes(_truncate(path.read_bytes()))
    reader = DiskStore(store.path, read_only=True)
    assert reader.get("k") is None
    assert reader.counters.corrupt == 1
    assert path.exists()


def test_failed_publish_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("old"))
    before = store.usage()

    def no_space(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(StoreError, match="cannot store"):
        store.put("k", entry_of("new"))
    with pytest.raises(StoreError):
        store.put("fresh", entry_of("fresh"))
    monkeypatch.undo()
    assert store.counters.errors == 2
    assert staging_items(store) == []
    assert store.get("k") == entry_of("old")
    assert store.get("fresh") is None
    assert store.usage() == before


def test_failed_write_leaves_no_staging_litter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "c")
    real_write = os.write
    calls = []

    def write_then_fail(fd: int, buffers: Any) -> int:
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, b"".join(buffers)[:100])  # a short write first

    # Files are written with one os.writev (kernelcache._fs.write_new).
    monkeypatch.setattr(os, "writev", write_then_fail)
    with pytest.raises(StoreError):
        store.put("k", entry_of("k"))
    monkeypatch.undo()
    assert staging_items(store) == []
    assert list(store.keys()) == []
    # Through the Cache the same failure is a counted miss, not an exception.
    monkeypatch.setattr(os, "writev", write_then_fail)
    calls.clear()
    cache = Cache([store])
    cache.put("k", entry_of("k"))
    monkeypatch.undo()
    assert cache.get("k") is None
    assert cache.stats()["disk"]["errors"] == 2


def test_stale_staging_is_swept_on_open_and_fresh_staging_stays(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    staging = Path(store.layout.staging)
    old_file = staging / "k.0123.tmp"
    old_dir = staging / "extract.0123"
    fresh_file = staging / "k.4567.tmp"  # a writer that is still running
    old_file.write_bytes(b"partial")
    old_dir.mkdir()
    (old_dir / "kernel.cubin").write_bytes(b"partial")
    fresh_file.write_bytes(b"partial")
    two_hours_ago = time.time() - 2 * disk.STALE_STAGING_SECONDS
    for path in (old_file, old_dir / "kernel.cubin", old_dir):
        os.utime(path, (two_hours_ago, two_hours_ago))
    DiskStore(store.path)
    assert sorted(os.listdir(staging)) == ["k.4567.tmp"]
    DiskStore(store.path, read_only=True)  # a read-only store sweeps nothing
    assert fresh_file.exists()


def test_eviction_spares_an_entry_republished_after_it_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process re-publishes the victim between the eviction's choice and its
    unlink; the guarded unlink sees a new inode and puts that entry back."""
    store = DiskStore(tmp_path / "c", max_entries=3)
    victim, second, third, trigger = "victim", "second", "third", "trigger"
    for age, key in enumerate((victim, second, third)):
        store.put(key, entry_of(key))
        then = time.time() - 100 + age  # victim is the least recently used
        os.utime(entry_file(store, key), (then, then))
    newer = entry_of("republished")
    real_rename = os.rename
    republished: list[Any] = []

    def rename(src: Any, dst: Any, **at: int | None) -> None:
        # The entry, named relative to its open shard folder (Layout.at).
        if os.path.basename(src) == entry_file(store, victim).name and not republished:
            # What another process's put does: stage the new entry, publish it by rename.
            staged = Path(store.layout.staging, "other-process.tmp")
            staged.write_bytes(newer.pack(victim))
            os.replace(staged, entry_file(store, victim))
            republished.append(src)
        real_rename(src, dst, **at)

    monkeypatch.setattr(os, "rename", rename)
    store.put(trigger, entry_of(trigger))  # 4 > 3: evict the least recently used one
    monkeypatch.undo()
    assert republished
    assert store.get(victim) == newer
    assert store.counters.evictions == 1
    assert store.get(second) is None
    assert store.get(third) is not None
    assert staging_items(store) == []


def test_entry_path_is_a_verified_file_inside_the_store(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k", 50_000))
    got = store.get("k")
    assert got is not None
    path = got.path("kernel.cubin")
    assert path.startswith(store.path + os.sep)
    assert Path(path).read_bytes() == got["kernel.cubin"]
    assert got.path("kernel.cubin") == path  # extracted once
    again = store.get("k")
    assert again is not None
    assert again.path("kernel.cubin") == path
    # The extracted bytes count toward the cap and are freed with the entry.
    assert store.usage()[1] >= entry_file(store, "k").stat().st_size + 50_000
    store.delete("k")
    assert not Path(path).exists()
    assert store.usage() == (0, 0)


def test_concurrent_extraction_is_benign(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k", 200_000))
    entries = [store.get("k") for _ in range(8)]
    barrier = threading.Barrier(len(entries))
    paths: list[str] = []
    errors: list[BaseException] = []

    def extract(entry: Entry | None) -> None:
        assert entry is not None
        barrier.wait()
        try:
            paths.append(entry.path("kernel.cubin"))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=extract, args=(e,)) for e in entries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(paths)) == 1
    assert Path(paths[0]).read_bytes() == entry_of("k", 200_000)["kernel.cubin"]
    assert staging_items(store) == []
    file_bytes = entry_file(store, "k").stat().st_size
    assert store.usage() == (1, file_bytes + 200_000 + 2)  # extracted once, counted once


def test_extraction_finished_by_another_process_meanwhile_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that found no extracted file must not remove the complete one
    another process extracted (and may be loading) in the meantime."""
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    mine, theirs = store.get("k"), store.get("k")
    assert mine is not None
    assert theirs is not None
    real_serves = Extractor.serves
    loader: list[int] = []
    raced: list[bool] = []

    def serves(self: Extractor, folder: str, target: str, data: bytes) -> bool:
        if not raced:  # the first look: the other process wins the race right after it
            raced.append(True)
            loader.append(os.open(theirs.path("kernel.cubin"), os.O_RDONLY))
            return False  # as seen just before it did
        return real_serves(self, folder, target, data)

    monkeypatch.setattr(Extractor, "serves", serves)
    try:
        path = mine.path("kernel.cubin")
        monkeypatch.undo()
        # The very file the other process opened is still the one at the path.
        assert os.stat(path).st_ino == os.fstat(loader[0]).st_ino
    finally:
        for fd in loader:
            os.close(fd)
    assert store.usage()[1] == entry_file(store, "k").stat().st_size + 2000 + 2


def test_damaged_extraction_is_redone(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    got = store.get("k")
    assert got is not None
    path = Path(got.path("kernel.cubin"))
    path.write_bytes(b"cut")
    again = store.get("k")
    assert again is not None
    assert Path(again.path("kernel.cubin")).read_bytes() == got["kernel.cubin"]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(b"\x01\x02\x03"), id="cut"),
        pytest.param(lambda p: p.write_bytes(os.urandom(32)), id="garbage"),
        pytest.param(lambda p: p.write_bytes(bytes(32)), id="zeros"),
        pytest.param(lambda p: p.unlink(), id="missing"),
    ],
)
def test_damaged_or_missing_counter_is_recounted_before_use(tmp_path: Path, damage: Any) -> None:
    store = DiskStore(tmp_path / "c", max_bytes=10_000_000, max_entries=100)
    keys = [f"k{i}" for i in range(4)]
    for key in keys[:3]:
        store.put(key, entry_of(key))
    damage(Path(store.layout.space))
    store.put(keys[3], entry_of(keys[3]))
    assert store.counters.evictions == 0
    assert store.usage() == (4, sum(entry_file(store, key).stat().st_size for key in keys))
    assert all(store.get(key) is not None for key in keys)


def test_what_the_shard_accounting_left_is_removed_on_open(tmp_path: Path) -> None:
    """0.1 kept copies in v1/files/<s>/<key>.<tag>/ and counters in v1/shards/: uncounted now."""
    store = DiskStore(tmp_path / "c")
    store.put("k", entry_of("k"))
    root = Path(store.path)
    old_copy = root / "v1" / "files" / shard_of("k") / f"k.{'0' * 16}" / "kernel.cubin"
    old_copy.parent.mkdir(parents=True)
    old_copy.write_bytes(b"x" * 1000)
    (root / "v1" / "shards").mkdir()
    (root / "v1" / "shards" / "0").write_bytes(bytes(16))
    reopened = DiskStore(root)
    assert not (root / "v1" / "files").exists()
    assert not (root / "v1" / "shards").exists()
    assert reopened.get("k") == entry_of("k")
    assert reopened.usage() == (1, entry_file(store, "k").stat().st_size)
    DiskStore(root, read_only=True)  # a read-only open removes nothing (nothing left to see)


@pytest.mark.parametrize("short", [False, True], ids=["whole", "short-writes"])
def test_an_entry_of_more_parts_than_one_writev_takes_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: bool
) -> None:
    """Entries go out in one writev of at most IOV_MAX buffers; the rest, and whatever a
    short write left, follow (the file is then the packed entry, byte for byte)."""
    artifacts = {f"a{i}": bytes([i % 251]) * (i % 7) for i in range(2500)}
    real_writev = os.writev
    calls = []

    def writev(fd: int, buffers: list[bytes]) -> int:
        calls.append(len(buffers))
        if short:  # the kernel may take less than it was given: here, about half
            joined = b"".join(buffers)
            return os.write(fd, joined[: max(1, len(joined) // 2)])
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    with DiskStore(tmp_path / "c") as store:
        store.put("k", Entry(artifacts))
        monkeypatch.undo()
        assert entry_file(store, "k").read_bytes() == Entry(artifacts).pack("k")
        got = store.get("k")
        assert got is not None
        assert dict(got) == artifacts
    assert max(calls) <= 1024
    assert len(calls) > 2
