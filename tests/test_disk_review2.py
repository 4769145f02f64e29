"""Second review of the disk tier after the pack, netput and wake merges: each test shows a
bug found where packs meet the rest of the tier (fixed, or ``xfail(strict=True)`` with the
fix idea in its reason). Damage is made to the pack's real bytes; read-only media are a
real read-only bind mount (as root) or folders without write permission.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from disk_entries import entry, flip_packed_byte, in_shard, read_only
from kernelcache import Entry
from kernelcache.stores.disk import DiskStore, pack, shard_of

# A damaged packed record on read-only media -----------------------------------------


def test_a_damaged_packed_record_on_read_only_media_is_a_counted_miss(tmp_path: Path) -> None:
    """A get that finds a packed record damaged removes it; on read-only media (a tier that
    still serves reads) that removal fails with EROFS, which raised StoreError out of get,
    where a damaged entry file is a counted miss (DiskStore._corrupt)."""
    root = tmp_path / "c"
    good, bad = in_shard("3", 1, "good")[0], in_shard("3", 1, "bad")[0]
    writer = DiskStore(root)
    writer.put(good, entry(good))
    writer.put(bad, entry(bad))
    flip_packed_byte(writer, bad, 3000)  # inside its data
    writer.close()
    with read_only(root):
        store = DiskStore(root)  # not read_only: the media are
        try:
            assert store.get(good) == entry(good)
            assert store.get(bad) is None
            assert store.counters.corrupt == 1
            assert store.counters.misses == 1
            assert store.get(good) == entry(good)  # the tier still serves
        finally:
            store.close()


# Reader threads while another process compacts ----------------------------------------


def _replace_until_compacted(root: str, keys: list[str], compactions: int) -> None:
    """Replace ``keys``' packed entries until their shard was compacted ``compactions`` times."""
    store = DiskStore(root)
    assert store.packs is not None
    first = store.packs.locked_shard(shard_of(keys[0])).header()[2]  # type: ignore[union-attr]
    n = 0
    while store.packs.locked_shard(shard_of(keys[0])).header()[2] < first + compactions:  # type: ignore[union-attr]
        n += 1
        for key in keys:
            store.put(key, Entry({"data": key.encode() * 300 + str(n).encode()}))
    store.close()


def test_reader_threads_survive_compactions_by_another_process(tmp_path: Path) -> None:
    """Two threads that both saw a shard's index retired each removed it from the open
    shards (``del``): the second raised KeyError out of get. Racy by nature: before the
    fix most runs of this size failed, none after it. (Misses of keys that were there all
    along are not asserted: a rare one is left, see the review's report.)"""
    root = str(tmp_path / "c")
    keys = [in_shard("3", 1, f"t{i}")[0] for i in range(4)]
    writer = DiskStore(root)
    for key in keys:
        writer.put(key, Entry({"data": key.encode() * 300}))
    writer.close()
    reader = DiskStore(root)
    failures: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            for key in keys:
                try:
                    reader.get(key)
                except Exception as exc:  # recorded, asserted below
                    failures.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch between the check and the removal
    threads = [threading.Thread(target=read) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        child = multiprocessing.get_context("spawn").Process(
            target=_replace_until_compacted, args=(root, keys, 400)
        )
        child.start()
        child.join()
    finally:
        done.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(old)
    assert child.exitcode == 0
    assert failures == []
    assert reader.counters.hits > 0
    assert reader.counters.errors == 0
    for key in keys:
        assert reader.get(key) is not None
    reader.close()


# A shard folder removed and made again while a store holds it open -----------------------


def test_a_store_removes_entries_of_a_shard_folder_made_again_since_it_opened_it(
    tmp_path: Path,
) -> None:
    """Removals name their file relative to the shard folders the store opened (Layout.at):
    once those were removed and another store made the shard again, every delete, clear
    and eviction of this store in the shard found nothing and left the entry served, and
    its extracted copies (before the open folders, removals named the path)."""
    root = tmp_path / "c"
    first, second, third = (in_shard("3", 1, p)[0] for p in ("one", "two", "three"))
    big = {k: entry(k, 40_000) for k in (first, second, third)}  # files, not packed
    long_lived = DiskStore(root)
    long_lived.put(first, big[first])
    assert long_lived.delete(first)  # the shard's folders are open now
    for top in ("entries", "extracted"):
        shutil.rmtree(root / "v1" / top / "3")  # by hand
    other = DiskStore(root)
    other.put(second, big[second])
    other.put(third, big[third])
    got = other.get(second)
    assert got is not None
    assert Path(got.path("data")).read_bytes() == big[second]["data"]  # an extracted copy
    assert long_lived.delete(second)
    assert other.get(second) is None
    assert not os.listdir(root / "v1" / "extracted" / "3")  # the copy went with it
    assert long_lived.clear() == 1
    assert other.get(third) is None
    assert not os.listdir(root / "v1" / "entries" / "3")
    assert long_lived.usage() == (0, 0)
    other.close()
    long_lived.close()


# A pack removed by hand while a store has it mapped ----------------------------------------


def test_a_pack_removed_by_hand_is_not_served_after_a_new_version_is_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit checks its shard's data file at most every RECHECK_SECONDS: here, each time."""
    monkeypatch.setattr(pack, "RECHECK_SECONDS", 0.0)
    root = tmp_path / "c"
    key = in_shard("5", 1, "hand")[0]
    long_lived = DiskStore(root)
    long_lived.put(key, Entry({"data": b"old" * 100}))
    assert long_lived.get(key) == Entry({"data": b"old" * 100})
    shutil.rmtree(root / "v1" / "packs")  # by hand: the tier's version is gone
    other = DiskStore(root)
    assert other.get(key) is None
    other.put(key, Entry({"data": b"new" * 100}))
    try:
        assert long_lived.get(key) == Entry({"data": b"new" * 100})
    finally:
        other.close()
        long_lived.close()


# The cache directory moved aside and made again while a store has it open -------------------


def _put_after_the_directory_moved(root: str) -> None:
    """Put into ``root`` once it was moved aside and made again by another store."""
    long_lived = DiskStore(root)
    long_lived.put("before", Entry({"data": b"x" * 100}))
    os.rename(root, root + ".aside")
    DiskStore(root).put("other", Entry({"data": b"y" * 100}))
    long_lived.put("after", Entry({"data": b"z" * 100}))  # packed: the space lock
    long_lived.close()


def test_a_put_after_the_cache_directory_was_moved_aside_and_made_again_does_not_hang(
    tmp_path: Path,
) -> None:
    """The space lock opens the counter relative to the open v1 folder and checks it by
    path: once the folder was moved aside (and a new tree made at its name), every
    attempt opened the moved counter again, found it was not the one at the path, and
    started over: forever, a CPU spinning with the tier's thread lock held."""
    root = str(tmp_path / "c")
    child = multiprocessing.get_context("spawn").Process(
        target=_put_after_the_directory_moved, args=(root,)
    )
    child.start()
    child.join(120)  # a hang, not a speed: the put takes milliseconds
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0
    assert DiskStore(root).get("after") == Entry({"data": b"z" * 100})


def test_a_file_put_after_the_cache_directory_was_moved_aside_and_made_again_is_stored(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    long_lived = DiskStore(root)
    long_lived.put("before", Entry({"data": b"x" * 40_000}))  # a file: staging is open
    os.rename(root, tmp_path / "aside")
    other = DiskStore(root)
    other.put("other", Entry({"data": b"y" * 100}))
    try:
        long_lived.put("after", Entry({"data": b"z" * 40_000}))
        assert other.get("after") == Entry({"data": b"z" * 40_000})
    finally:
        other.close()
        long_lived.close()
