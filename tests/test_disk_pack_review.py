"""Review of the small-entry packs (stores/disk/pack.py, packindex.py): each test shows a bug
the review found (each was an ``xfail(strict=True)`` until its fix), or one its fixes
touched. Crashes are real SIGKILLs of a real writer process at the step named; damage is
made to the pack's real bytes.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from disk_entries import entry, flip_packed_byte, in_shard, packs
from kernelcache import Entry, maintenance
from kernelcache.stores.disk import DiskStore, packindex
from kernelcache.stores.disk import pack as pack_module
from kernelcache.stores.disk.space import Space

SHARD = "3"
HEADER = 64  # packindex.py: magic, retired, slots, generation, end, used, live, dead
SLOT = 32  # key hash, offset, length, flags, clock


def slot_at(index: bytes | bytearray, offset: int) -> int:
    """Where in the index the slot whose record is at ``offset`` starts."""
    return next(
        at
        for at in range(HEADER, len(index), SLOT)
        if struct.unpack_from("<Q", index, at)[0] > 1
        and struct.unpack_from("<Q", index, at + 8)[0] == offset
    )


# A pack made by another process after this one missed in the shard -------------------


def test_a_pack_made_after_a_miss_is_seen_by_info_scan_clear_and_recount(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    reader = DiskStore(root)
    writer = DiskStore(root)  # another process's store: its own Packs
    keys = in_shard(SHARD, 5, "m")
    assert reader.get(keys[0]) is None  # no pack yet: remembered as absent
    for key in keys:
        writer.put(key, entry(key))
    assert writer.info(keys[1]) is not None
    got = writer.get(keys[2])
    assert got is not None
    path = Path(got.path("data"))  # extracted: a copy in the key's folder
    counted = reader.recount()
    assert path.exists()  # the reader took it as an orphan's folder
    assert counted == writer.recount()  # the reader's recount undercounts: cap
    assert sorted(reader.keys()) == sorted(keys)  # kernelcache ls
    assert reader.info(keys[1]) is not None  # kernelcache show
    assert reader.clear() == len(keys)


def test_a_replace_or_delete_after_a_miss_removes_the_version_another_process_packed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    replacer = DiskStore(root)
    writer = DiskStore(root)  # another process's store: its own Packs
    replaced, deleted = in_shard(SHARD, 2, "w")
    assert replacer.get(replaced) is None  # no pack yet: remembered as absent
    writer.put(replaced, entry(replaced))
    writer.put(deleted, entry(deleted))
    large = entry(replaced, 40_000)  # a file, not packed
    replacer.put(replaced, large)
    fresh = DiskStore(root)
    assert fresh.get(replaced) == large  # the old packed version on the branch
    assert replacer.delete(deleted)
    assert fresh.get(deleted) is None
    assert fresh.usage() == fresh.recount()


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param((4000, 40_000), id="packed-to-file"),
        pytest.param((40_000, 4000), id="file-to-packed"),
        pytest.param((40_000, 40_001), id="file-to-file"),  # as on main: passes
    ],
)
def test_a_replace_keeps_the_extracted_copy_of_the_old_version(
    tmp_path: Path, sizes: tuple[int, int]
) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    (key,) = in_shard(SHARD, 1, "x")
    store.put(key, entry(key, sizes[0]))
    got = store.get(key)
    assert got is not None
    path = Path(got.path("data"))  # handed to a loader, say
    DiskStore(root).put(key, entry(key, sizes[1]))  # another process publishes a new version
    assert path.read_bytes() == entry(key, sizes[0])["data"]


# Removals that name a record by its offset, across a compaction ----------------------


@pytest.mark.parametrize("how", ["clear", "prune"])
def test_clear_and_prune_remove_a_whole_shard_across_its_compaction(
    tmp_path: Path, how: str
) -> None:
    store = DiskStore(tmp_path / "c")
    keys = in_shard(SHARD, 40, "a")
    for key in keys:
        store.put(key, entry(key))
    if how == "clear":
        assert store.clear() == len(keys)
        assert list(store.keys()) == []
    else:
        maintenance.prune(store, max_bytes=20_000)
        assert store.usage()[1] <= 20_000


# A compaction killed between its rename and the retired flag ---------------------------


def killed_in(target: Callable[..., None], *args: object) -> None:
    """Run ``target(*args)`` in a spawned process that kills itself (SIGKILL) part way
    through a write; return once it is dead, as planned."""
    child = multiprocessing.get_context("spawn").Process(target=target, args=args)
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL


def _compact_then_die(root: str, key: str, before_rename: bool = False) -> None:
    """Replace ``key`` until its shard's pack is compacted; die (SIGKILL) right after the
    new index is renamed over the old one (or right before, ``before_rename``)."""
    write = pack_module.Packs._write  # noqa: SLF001

    def write_then_die(
        self: pack_module.Packs,
        name: str,
        gen: int,
        records: list[tuple[int, bytes, int]],
        slots: int,
    ) -> None:
        if gen > 1 and before_rename:
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, name, gen, records, slots)
        if gen > 1:
            os.kill(os.getpid(), signal.SIGKILL)

    pack_module.Packs._write = write_then_die  # type: ignore[method-assign]  # noqa: SLF001
    store = DiskStore(root)
    for i in range(200):
        store.put(key, entry(key, 4000 - i % 2))


@pytest.mark.parametrize("before_rename", [False, True], ids=["after-rename", "before-rename"])
def test_a_compaction_killed_before_retiring_leaves_no_stale_entry(
    tmp_path: Path, before_rename: bool
) -> None:
    root = str(tmp_path / "c")
    old, other, churn = in_shard(SHARD, 3, "r")
    holder = DiskStore(root)  # a long-lived process: the shard's index stays open
    holder.put(old, entry(old))
    assert holder.get(old) == entry(old)
    killed_in(_compact_then_die, root, churn, before_rename)  # mid-compaction, as planned
    fresh = DiskStore(root)  # a process started since: it opens the new index
    assert fresh.delete(old)
    assert holder.get(old) is None  # deleted: the holder's old index still serves it
    holder.put(other, entry(other))  # the holder writes (and compacts) its old index
    assert DiskStore(root).get(old) is None  # the deletion must not be undone
    assert DiskStore(root).get(other) == entry(other)
    # What the killed compaction left (a data file of another generation) was swept.
    assert len(list(packs(holder).glob(f"{SHARD}.*.dat"))) == 1


# A writer killed between its append and removing the key's old entry file ------------


def _pack_then_die_before_removing_the_file(root: str, key: str) -> None:
    def die(*_args: object, **_kwargs: object) -> bool:
        os.kill(os.getpid(), signal.SIGKILL)
        return False

    Space.remove_file_locked = die  # type: ignore[method-assign]
    DiskStore(root).put(key, entry(key, 3000))


def test_a_clear_after_a_killed_packed_replace_of_a_file_leaves_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "c")
    (key,) = in_shard(SHARD, 1, "p")
    DiskStore(root).put(key, entry(key, 40_000))  # a file
    killed_in(_pack_then_die_before_removing_the_file, root, key)
    store = DiskStore(root)
    assert store.get(key) == entry(key, 3000)  # the packed version is what hits
    store.clear()
    assert DiskStore(root).get(key) is None  # cleared: nothing may hit


# A writer killed between filling the slot and updating the header ----------------------


def _put_then_die_before_header(root: str, key: str) -> None:
    def die(self: object, fields: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    store = DiskStore(root)
    packindex.ShardIndex.set_header = die  # type: ignore[method-assign]
    store.put(key, entry(key, 3000))


def test_a_writer_killed_between_slot_and_header_leaves_a_usable_pack(tmp_path: Path) -> None:
    root = str(tmp_path / "c")
    first, victim, after = in_shard(SHARD, 3, "h")
    DiskStore(root).put(first, entry(first, 100))  # the pack exists, small live bytes
    killed_in(_put_then_die_before_header, root, victim)
    store = DiskStore(root)
    assert store.get(victim) in (None, entry(victim, 3000))
    store.delete(victim)  # struct.error on the branch: the header's live bytes go below 0
    store.put(after, entry(after, 3100))
    assert store.get(after) == entry(after, 3100)
    store.put(victim, entry(victim))
    assert DiskStore(root).get(victim) == entry(victim)
    assert store.counters.errors == 0


def test_a_header_whose_live_bytes_are_too_low_still_deletes(tmp_path: Path) -> None:
    """What a writer killed between slot and header left before the header went first."""
    root = tmp_path / "c"
    store = DiskStore(root)
    keys = in_shard(SHARD, 2, "k")
    for key in keys:
        store.put(key, entry(key))
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    index[48:56] = bytes(8)  # the header's live bytes: 0
    index_path.write_bytes(bytes(index))
    other = DiskStore(root)
    assert other.delete(keys[0])  # struct.error before the header's fields were clamped
    assert other.get(keys[0]) is None
    assert other.get(keys[1]) == entry(keys[1])
    assert other.counters.errors == 0


# A compaction that fails (a full disk) after the record was published -----------------


def test_a_full_disk_during_compaction_leaves_the_counter_high_never_low(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "c")
    (key,) = in_shard(SHARD, 1, "n")
    store.put(key, entry(key, 1000))

    def no_space(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    # Compaction writes its new files with os.writev (_fs.write_new); appends use pwritev.
    monkeypatch.setattr(os, "writev", no_space)
    size = 1000
    while store.counters.errors == 0 and size < 16_000:
        size += 100  # each version larger than the one it replaces
        store.put(key, entry(key, size))  # stored: its compaction is best effort
    monkeypatch.undo()
    assert store.counters.errors == 1  # the compaction ran, and failed (counted, not raised)
    counted, real = store.usage(), store.recount()
    assert counted == real  # the put that compacted was counted before it
    assert store.get(key) == entry(key, size)
    store.put(key, entry(key, size + 100))  # the next change compacts
    assert store.get(key) == entry(key, size + 100)
    assert store.usage() == store.recount()


# Damaged index values: only misses, never an exception or a hang -----------------------


def test_a_slot_offset_past_what_pread_takes_is_a_counted_miss(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    keys = in_shard(SHARD, 3, "o")
    for key in keys:
        store.put(key, entry(key))
    info = store.info(keys[1])
    assert info is not None
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    at = slot_at(index, info.extra["record"])
    index[at + 8 : at + 16] = b"\xff" * 8
    index_path.write_bytes(bytes(index))
    reader = DiskStore(root)
    assert {i.key for i in reader.scan()} >= {keys[0], keys[2]}  # ls: OverflowError
    assert reader.get(keys[1]) is None  # OverflowError on the branch
    assert reader.counters.corrupt == 1
    assert reader.get(keys[0]) == entry(keys[0])
    reader.put(keys[1], entry(keys[1]))
    assert reader.get(keys[1]) == entry(keys[1])


@pytest.mark.parametrize("end", [1 << 62, (1 << 64) - 1])
def test_a_damaged_pack_end_still_accepts_puts(tmp_path: Path, end: int) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    first, second = in_shard(SHARD, 2, "e")
    store.put(first, entry(first))
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    index[32:40] = end.to_bytes(8, "little")  # the header's end of data
    index_path.write_bytes(bytes(index))
    writer = DiskStore(root)
    writer.put(second, entry(second))
    assert DiskStore(root).get(second) == entry(second)
    assert writer.usage() == writer.recount()


class _Hung(BaseException):
    """Raised by the alarm: the put never returned (not an Exception: nothing catches it)."""


def _hung(_signum: int, _frame: FrameType | None) -> None:
    raise _Hung


def test_an_index_header_with_no_slots_is_refused_and_puts_go_on(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    (key,) = in_shard(SHARD, 1, "z")
    store.put(key, entry(key))
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    index[16:24] = bytes(8)  # slots: 0
    index_path.write_bytes(bytes(index))
    reader = DiskStore(root)
    assert reader.get(key) is None
    assert reader.counters.refused + reader.counters.corrupt >= 1  # damage is counted
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)  # only reached once the damage is counted (fixed): a hang, not a bound
    try:
        reader.put(key, entry(key))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert DiskStore(root).get(key) == entry(key)


@pytest.mark.parametrize("slots", [1, 3, 1 << 40])
def test_an_index_header_with_a_slot_count_no_index_has_is_refused(
    tmp_path: Path, slots: int
) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    (key,) = in_shard(SHARD, 1, "y")
    store.put(key, entry(key))
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    index[16:24] = slots.to_bytes(8, "little")
    index_path.write_bytes(bytes(index))
    reader = DiskStore(root)
    assert reader.get(key) is None
    assert reader.counters.refused >= 1


def test_an_index_with_no_empty_slot_left_still_takes_puts(tmp_path: Path) -> None:
    """A header whose used count is damaged (0) over slots all tombstones: a put's probe
    for a free slot must end (it compacts, and grows, instead)."""
    root = tmp_path / "c"
    store = DiskStore(root)
    first, second = in_shard(SHARD, 2, "t")
    store.put(first, entry(first))
    store.delete(first)
    index_path = packs(store) / f"{SHARD}.idx"
    index = bytearray(index_path.read_bytes())
    index[40:48] = bytes(8)  # the header's used slots: 0
    for at in range(HEADER, len(index), SLOT):
        index[at : at + 8] = (1).to_bytes(8, "little")  # every slot a tombstone
    index_path.write_bytes(bytes(index))
    writer = DiskStore(root)
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)  # a hang, not a bound
    try:
        writer.put(second, entry(second))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert DiskStore(root).get(second) == entry(second)


# A link where the packs folder belongs ------------------------------------------------


def test_a_link_where_the_packs_folder_belongs_is_refused_and_replaced(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    small, large = in_shard(SHARD, 2, "l")
    store.put(large, entry(large, 40_000))  # a file: no pack needed to read it
    store.put(small, entry(small))
    elsewhere = tmp_path / "elsewhere"
    packs(store).rename(elsewhere)
    packs(store).symlink_to(elsewhere)
    other = DiskStore(root)
    assert other.get(large) == entry(large, 40_000)  # UnsafeDirectory on the branch
    assert other.get(small) is None  # its pack is refused
    other.put(small, entry(small))
    assert not packs(other).is_symlink()  # a writable tier replaces the link
    assert other.get(small) == entry(small)
    assert other.counters.refused >= 1
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
        [f"{SHARD}.idx", f"{SHARD}.1.dat"]
    )  # nothing was written through the link


# The cap: dead bytes -------------------------------------------------------------------


def test_replacing_every_entry_of_a_full_tier_keeps_the_packs_near_the_cap(
    tmp_path: Path,
) -> None:
    cap = 3_200_000
    store = DiskStore(tmp_path / "c", max_bytes=cap)
    keys = [f"f{i:05d}" for i in range(cap // 4100)]
    for key in keys:
        store.put(key, entry(key))
    for key in keys:
        new = Entry({"data": entry(key)["data"][::-1]})  # as large, other bytes
        store.put(key, new)  # one new version of each
    assert store.usage()[1] <= cap
    on_disk = sum(f.stat().st_size for f in packs(store).glob("*.dat"))
    # What the docs promise: at most 64 KB per shard beyond what the cap counts.
    assert on_disk <= cap + 16 * (1 << 16)


# verify and ls: a record whose header is damaged -----------------------------------------


def test_verify_reports_a_packed_record_whose_header_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    keys = in_shard(SHARD, 3, "v")
    for key in keys:
        store.put(key, entry(key))
    flip_packed_byte(store, keys[1], 0)  # the entry's magic
    checker = DiskStore(root)
    listed = {i.key: i for i in checker.scan()}
    assert keys[1] in listed  # a damaged entry file is listed by its name
    assert checker.check(listed[keys[1]]) is not None


def test_a_compaction_drops_a_damaged_record_instead_of_copying_it(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    keys = in_shard(SHARD, 3, "d")
    for key in keys:
        store.put(key, entry(key))
    flip_packed_byte(store, keys[1], 1000)  # inside the entry's data
    writer = DiskStore(root)
    first = set(packs(store).glob(f"{SHARD}.*.dat"))
    for i in range(12):  # replaced until the dead bytes make the shard compact
        writer.put(keys[0], entry(keys[0], 4000 - i % 2))
    assert set(packs(store).glob(f"{SHARD}.*.dat")) != first  # compacted
    reader = DiskStore(root)
    assert reader.info(keys[1]) is None  # dropped, not copied on
    assert reader.get(keys[1]) is None
    assert reader.counters.corrupt == 0  # it is gone, not read
    assert reader.get(keys[2]) == entry(keys[2])
    assert reader.usage() == reader.recount()
