"""Small entries packed per shard on local disk (issue 40, stores/disk/pack.py).

Real processes race on one shard's pack; damage is made by cutting and
flipping the pack's real bytes; the CLI runs as a real process.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from cli_run import kc as cli
from disk_entries import data_file, entry, in_shard, packs, value
from kernelcache import Settings, StoreError
from kernelcache.stores.disk import DiskStore, shard_of
from kernelcache.stores.disk.packindex import PACK_MAX

SRC = str(Path(__file__).resolve().parents[1] / "src")
SHARD = "3"


def on_disk(store: DiskStore) -> int:
    """Bytes of the tier's entry files, packed records and extracted copies: what the
    counter counts, and the dead records of packs (at most 1 % of a cap: pack.py); the cap
    bounds it. A pack's index (32 B a slot) is left out, as directories are."""
    base = Path(store.layout.base)
    return sum(
        p.stat().st_size
        for top in ("entries", "packs", "extracted")
        for p in (base / top).rglob("*")
        if p.is_file() and p.suffix != ".idx"
    )


def test_small_entries_are_packed_and_large_ones_stay_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("small", entry("small"))
    store.put("large", entry("large", PACK_MAX + 1))
    assert not Path(store.layout.entry_path("small")).exists()
    assert Path(store.layout.entry_path("large")).is_file()
    assert (packs(store) / f"{shard_of('small')}.idx").is_file()
    other = DiskStore(tmp_path / "c")  # another process's view: a fresh store
    assert other.get("small") == entry("small")
    assert other.get("large") == entry("large", PACK_MAX + 1)
    assert other.usage() == (2, on_disk(other))
    assert store.recount() == other.usage()


def test_a_cache_of_entry_files_still_hits_and_a_packed_put_replaces_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = DiskStore(tmp_path / "c")
    old.pack_max = 0  # the layout before packing: a file per entry
    old.put("k", entry("k"))
    assert Path(old.layout.entry_path("k")).is_file()
    store = DiskStore(tmp_path / "c")
    assert store.get("k") == entry("k")
    store.put("k", entry("k", 3000))
    assert not Path(store.layout.entry_path("k")).exists()  # one entry per key
    assert store.get("k") == entry("k", 3000)
    assert store.usage() == store.recount() == (1, on_disk(store))


def _race(root: str, keys: list[str], shared: list[str], rounds: int) -> None:
    store = DiskStore(root)
    for _ in range(rounds):
        for key in keys:
            store.put(key, entry(key))
        for key in shared:  # every process replaces these: dead bytes, then compaction
            store.put(key, entry(key, 3000))
        for key in keys[::3]:
            store.delete(key)
        for key in keys[::3]:
            store.put(key, entry(key))
    store.close()


def _reader(root: str, keys: list[str], stop: Event, out: multiprocessing.Queue[int]) -> None:
    """Reads the stable keys while writers compact the shard, until they are done (once
    at least): every get must hit, verified."""
    store = DiskStore(root)
    bad = reads = 0
    while reads == 0 or not stop.is_set():
        for key in keys:
            got = store.get(key)
            reads += 1
            if got != entry(key):
                bad += 1
    out.put(bad)
    out.put(reads)
    out.put(store.counters.corrupt)


def test_processes_racing_on_one_shard_keep_every_entry_while_it_is_compacted(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "c")
    stable = in_shard(SHARD, 20, "s")
    first = DiskStore(root)
    for key in stable:
        first.put(key, entry(key))
    shared = in_shard(SHARD, 8, "x")
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[int] = ctx.Queue()
    # Until the writers are done, not for a fixed time: a reader started late on a loaded
    # machine read nothing within its 8 s (reads == 0), one started early outlived them.
    stop = ctx.Event()
    reader = ctx.Process(target=_reader, args=(root, stable, stop, results))
    reader.start()
    writers = [
        ctx.Process(target=_race, args=(root, in_shard(SHARD, 30, f"w{n}"), shared, 4))
        for n in range(3)
    ]
    try:
        for w in writers:
            w.start()
        for w in writers:
            w.join(120)
            assert w.exitcode == 0
    finally:
        stop.set()
    reader.join(120)
    bad, reads, corrupt = results.get(), results.get(), results.get()
    assert reader.exitcode == 0
    assert reads > 0
    assert (bad, corrupt) == (0, 0)
    store = DiskStore(root)
    gen = int(data_file(store, SHARD).name.split(".")[1])
    assert gen > 1  # the shard was compacted (or grown) while the reader read
    for n in range(3):
        for key in in_shard(SHARD, 30, f"w{n}"):
            assert store.get(key) == entry(key)
    for key in shared:
        assert store.get(key) == entry(key, 3000)
    for key in stable:
        assert store.get(key) == entry(key)
    assert store.counters.corrupt == 0
    assert store.usage() == store.recount()
    assert store.usage()[0] == 20 + 90 + 8
    assert store.usage()[1] <= on_disk(store)  # dead records are not counted


def _append_forever(root: str, prefix: str) -> None:
    store = DiskStore(root)
    i = 0
    while True:
        key = in_shard(SHARD, i + 1, prefix)[-1]
        store.put(key, entry(key))
        i += 1


def test_a_writer_killed_mid_append_leaves_only_dead_bytes(tmp_path: Path) -> None:
    root = str(tmp_path / "c")
    store = DiskStore(root)
    store.put(in_shard(SHARD, 1, "a")[0], entry("a"))  # the pack exists before the child
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_append_forever, args=(root, "k"))
    child.start()
    # Until the child has published ~60 KB (the tier's counter: summing the packs' sizes
    # raced the child's compactions, which remove the data file a glob just listed).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and store.usage()[1] < 60_000:
        time.sleep(0.01)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    # What a kill in the middle of an append leaves: bytes past the pack's end.
    with data_file(store, SHARD).open("ab") as f:
        f.write(b"KCENTRY\n" + b"\xff" * 500)
    fresh = DiskStore(root)
    held = [key for key in in_shard(SHARD, 200, "k") if fresh.get(key) is not None]
    assert held  # what was published before the kill is there, verified
    assert fresh.counters.corrupt == 0
    assert fresh.counters.errors == 0
    fresh.put("after", entry("after"))  # appends over the torn bytes
    assert DiskStore(root).get("after") == entry("after")
    for key in held:
        assert fresh.get(key) == entry(key)
    counted, real = fresh.usage(), fresh.recount()
    assert counted[0] >= real[0]  # a kill between counting and appending leaves it high,
    assert counted[1] >= real[1]  # never low (stores/disk/space.py)


@pytest.mark.parametrize("where", ["record-cut", "record-flip", "slot-offset", "slot-length"])
def test_a_damaged_record_or_slot_is_a_counted_miss(tmp_path: Path, where: str) -> None:
    store = DiskStore(tmp_path / "c")
    keys = in_shard(SHARD, 3, "d")
    for key in keys:
        store.put(key, entry(key))
    victim = keys[1]
    info = store.info(victim)
    assert info is not None
    record = info.extra["record"]
    pack = data_file(store, SHARD)
    raw = bytearray(pack.read_bytes())
    if where == "record-cut":
        pack.write_bytes(bytes(raw[: record + 100]))
    elif where == "record-flip":
        raw[record + 2000] ^= 0x40
        pack.write_bytes(bytes(raw))
    else:
        index = packs(store) / f"{SHARD}.idx"
        slots = bytearray(index.read_bytes())
        # Slots (pack.py): 64-byte header, then 32 bytes each with the offset at +8.
        at = next(
            at
            for at in range(64 + 8, len(slots), 32)
            if slots[at : at + 8] == record.to_bytes(8, "little")
        )
        if where == "slot-offset":
            slots[at : at + 8] = (record + 7).to_bytes(8, "little")
        else:  # a length no put writes: nothing may allocate it
            slots[at + 8 : at + 12] = b"\xff\xff\xff\xff"
        index.write_bytes(bytes(slots))
    reader = DiskStore(tmp_path / "c")
    assert reader.get(victim) is None
    assert reader.counters.corrupt == 1
    assert reader.counters.misses == 1
    assert reader.get(victim) is None  # removed: a plain miss now
    assert reader.counters.corrupt == 1
    if where != "record-cut":
        for key in (keys[0], keys[2]):
            assert reader.get(key) == entry(key)
    reader.put(victim, entry(victim))
    assert reader.get(victim) == entry(victim)


def test_the_cap_holds_by_evicting_packed_entries_least_recently_used_first(
    tmp_path: Path,
) -> None:
    cap = 120_000
    store = DiskStore(tmp_path / "c", max_bytes=cap)
    keys = [f"c{i:04d}" for i in range(100)]
    for key in keys:
        store.put(key, entry(key))
        assert store.usage()[1] <= on_disk(store) <= cap  # dead records included
    assert store.counters.evictions >= 100 - cap // 4000
    assert store.usage() == store.recount()
    assert store.get(keys[0]) is None  # the oldest went
    assert store.get(keys[-1]) == entry(keys[-1])  # the newest stayed


def test_an_extracted_packed_entry_is_a_file_and_its_copies_are_counted(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    got = store.put("e", entry("e"))
    path = Path(got.path("data"))
    assert path.read_bytes() == value("e")
    assert store.usage() == store.recount() == (1, on_disk(store))
    assert on_disk(store) >= len(b"".join(entry("e").pack_parts("e"))) + 4000
    assert store.delete("e")
    assert not path.exists()
    assert store.usage()[0] == 0
    assert store.usage()[1] == 0 < on_disk(store)  # the dead record, until compaction


def kc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("--dir", str(root), *args, env={})


def test_ls_verify_prune_and_clear_see_packed_entries(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    keys = in_shard(SHARD, 4, "v")
    for key in keys:
        store.put(key, entry(key))
    listed = kc(root, "ls")
    assert listed.returncode == 0, listed.stderr
    assert all(key in listed.stdout for key in keys)
    info = store.info(keys[0])
    assert info is not None
    pack = data_file(store, SHARD)
    raw = bytearray(pack.read_bytes())
    raw[info.extra["record"] + 1000] ^= 1
    pack.write_bytes(bytes(raw))
    checked = kc(root, "verify", "--fix", "--json")
    assert keys[0] in checked.stdout
    assert all(key not in checked.stdout for key in keys[1:])
    assert DiskStore(root).get(keys[0]) is None
    assert sorted(DiskStore(root).keys()) == sorted(keys[1:])
    pruned = kc(root, "prune", "--max-entries", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert len(list(DiskStore(root).keys())) == 1
    cleared = kc(root, "clear", "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert list(DiskStore(root).keys()) == []
    assert DiskStore(root).recount() == (0, 0)


@pytest.mark.parametrize("how", ["other-owner", "others-write"])
def test_a_pack_others_could_write_is_refused(tmp_path: Path, how: str) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("t", entry("t"))
    index = packs(store) / f"{shard_of('t')}.idx"
    if how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file away")
        os.chown(index, 65534, 65534)
    else:
        index.chmod(0o666)
    reader = DiskStore(tmp_path / "c")
    assert reader.get("t") is None
    assert reader.counters.refused >= 1
    reader.put("t", entry("t"))  # a writable tier replaces the junk with its own pack
    assert DiskStore(tmp_path / "c").get("t") == entry("t")


def test_a_read_only_tier_reads_packed_entries_and_writes_nothing(tmp_path: Path) -> None:
    DiskStore(tmp_path / "c").put("r", entry("r"))
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")}
    reader = DiskStore.from_settings(Settings.load(dir=str(tmp_path / "c"), read_only=True))
    assert reader.get("r") == entry("r")
    with pytest.raises(StoreError):
        reader.put("s", entry("s"))
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")} == before


def test_a_network_filesystem_keeps_a_file_per_entry(two_nodes: Callable[..., object]) -> None:
    fs = two_nodes("shared")
    store = DiskStore(fs.nodes[0].path / "cache")  # type: ignore[attr-defined]
    assert store.filesystem.network
    assert store.packs is None
    store.put("n", entry("n"))
    assert Path(store.layout.entry_path("n")).is_file()
    assert DiskStore(fs.nodes[1].path / "cache").get("n") == entry("n")  # type: ignore[attr-defined]
    store.close()


def test_stats_count_packed_hits_of_a_durable_store(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", durable=True)
    store.put("h", entry("h"))
    assert store.get("h") is not None
    stats = store.stats()
    assert stats["hits"] == 1
    assert json.dumps(stats)


def test_a_pack_made_or_compacted_by_another_store_is_seen(tmp_path: Path) -> None:
    reader = DiskStore(tmp_path / "c")
    writer = DiskStore(tmp_path / "c")
    keys = in_shard(SHARD, 40, "g")
    assert reader.get(keys[0]) is None  # no pack yet: known absent
    writer.pack_max = PACK_MAX
    writer.put(keys[0], entry(keys[0]))
    assert reader.get(keys[0]) == entry(keys[0])  # the miss looked again
    for key in keys[1:]:  # replaced over and over: dead bytes, then compaction
        for size in (4000, 3000, 4000, 3000, 4000):
            writer.put(key, entry(key, size))
    assert int(data_file(writer, SHARD).name.split(".")[1]) > 1
    writer.delete(keys[0])
    assert reader.get(keys[0]) is None  # the reader's old index was retired: reopened
    assert reader.get(keys[-1]) == entry(keys[-1])
    assert reader.counters.corrupt == 0


def _child_of_fork(store: DiskStore, key: str) -> None:
    assert store.get(key) == entry(key)
    store.put(key + "c", entry(key + "c"))
    assert store.get(key + "c") == entry(key + "c")


def test_a_forked_child_uses_the_packs_of_its_own(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("f", entry("f"))
    assert store.get("f") == entry("f")  # the parent has the shard open
    child = multiprocessing.get_context("fork").Process(target=_child_of_fork, args=(store, "f"))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.get("fc") == entry("fc")
    assert store.get("f") == entry("f")
