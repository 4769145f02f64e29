"""The index of a shard's pack (:mod:`.pack`): a header and open-addressing slots, in a file
every process maps ``MAP_SHARED``.

Header (64 bytes): magic, retired flag, slot count (a power of two), generation
of the data file, end of the data, used slots, live bytes, dead bytes. Slot (32
bytes): key hash, record offset, record length, flags, clock (ns, last use).

A slot's hash is written last when it is filled, and replaced by the tombstone
when its record goes, so a reader that finds a hash finds the rest of the slot
written; it verifies the record it points to anyway. The retired flag is set in
an index that a compaction replaces (before its rename over it): every process
checks it before using its mapping, and reopens.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

#: Entries packed in at most this many bytes go in packs; larger ones stay files
#: (one pread of a big file is as fast as from a pack, and extraction wants files).
PACK_MAX = 16384
MAGIC = b"KCPACKI1"
#: More slots than any index grows to (2**24 slots: 512 MiB): a header saying so is damaged.
MAX_SLOTS = 1 << 24
#: No data file grows past this; a slot offset beyond it is damaged (pread takes < 2**63).
DATA_MAX = 1 << 62
#: magic, retired, slots, generation, end of data, used slots, live bytes, dead bytes
_HEADER = struct.Struct("<8sQQQQQQQ")
HEADER_SIZE = _HEADER.size
_SLOT = struct.Struct("<QQIIQ")  # key hash, offset, length, flags, clock (ns)
_HASH = struct.Struct("<Q")
_CLOCK = struct.Struct("<Q")
_RETIRED_AT = 8
_CLOCK_AT = 24  # within a slot
_EMPTY = 0
_U64_MAX = (1 << 64) - 1
_TOMB = 1


def index_size(slots: int) -> int:
    """Bytes of an index of ``slots`` slots."""
    return _HEADER.size + slots * _SLOT.size


def key_hash(key: str) -> int:
    """The slot hash of ``key``: never 0 (empty) or 1 (tombstone)."""
    h = xxhash.xxh3_64_intdigest(key.encode())
    return h if h > _TOMB else h + 2


def generation(mm: mmap.mmap) -> int | None:
    """The data file generation of the index mapped as ``mm``, or ``None`` if it is not an
    index of this format (damaged or foreign: its slot count must fit the file)."""
    magic, _retired, slots, gen, *_rest = _HEADER.unpack_from(mm, 0)
    if magic != MAGIC or not 2 <= slots <= MAX_SLOTS or slots & (slots - 1):
        return None
    if index_size(slots) > len(mm):
        return None
    return int(gen)


def build_index(records: Sequence[tuple[int, int, int]], slots: int, gen: int) -> bytes:
    """A fresh index of ``slots`` slots over ``records`` ``(hash, length, clock)``, laid out
    one after another from offset 0 of data file ``gen``."""
    index = bytearray(index_size(slots))
    mask = slots - 1
    offset = 0
    for h, length, clock in records:
        i = (h >> 4) & mask
        while _HASH.unpack_from(index, _HEADER.size + i * _SLOT.size)[0] != _EMPTY:
            i = (i + 1) & mask
        _SLOT.pack_into(index, _HEADER.size + i * _SLOT.size, h, offset, length, 0, clock)
        offset += length
    _HEADER.pack_into(index, 0, MAGIC, 0, slots, gen, offset, len(records), offset, 0)
    return bytes(index)


class ShardIndex:
    """One shard's open index (mapped) and data file (read-write where ``writable``)."""

    __slots__ = ("check_at", "data", "ino", "mask", "mm", "name", "slots", "writable")

    def __init__(self, name: str, mm: mmap.mmap, data: int, ino: int, writable: bool) -> None:
        self.name = name
        self.mm = mm
        self.data = data
        self.ino = ino
        self.slots = _HEADER.unpack_from(mm, 0)[2]
        self.mask = self.slots - 1
        self.writable = writable
        #: When a hit next checks that the data file is still linked (pack.Packs.shard).
        self.check_at = 0.0

    @property
    def retired(self) -> bool:
        return self.mm[_RETIRED_AT] != 0

    def retire(self, retired: bool = True) -> None:
        """Mark this index replaced: every process that has it mapped reopens."""
        self.mm[_RETIRED_AT] = int(retired)

    def header(self) -> list[int]:
        return list(_HEADER.unpack_from(self.mm, 0)[1:])

    def set_header(self, fields: Sequence[int]) -> None:
        """Write the header's ``fields`` (after the magic), each clamped to a u64: counts of
        a header a killed writer left off (live bytes low) never raise, they reach 0."""
        _HEADER.pack_into(self.mm, 0, MAGIC, *(min(max(f, 0), _U64_MAX) for f in fields))

    def find(self, h: int) -> int:
        """The slot number holding hash ``h``, or -1."""
        mm, mask = self.mm, self.mask
        i = (h >> 4) & mask
        for _ in range(self.slots):
            at = _HEADER.size + i * _SLOT.size
            found: int = _HASH.unpack_from(mm, at)[0]
            if found == h:
                return int(i)
            if found == _EMPTY:
                return -1
            i = (i + 1) & mask
        return -1

    def slot(self, i: int) -> tuple[int, int, int, int, int]:
        """``(hash, offset, length, flags, clock)``; a length no put writes (a damaged slot)
        reads as 0, so that nothing allocates what it claims, and an offset past
        :data:`DATA_MAX` reads as ``(0, 0)``: the record then fails its verification, a
        counted miss. (Not the header's end of data: readers would see it torn while a
        writer moves it, ``struct`` writes it byte by byte, and take a live record as
        damaged.)"""
        h, offset, length, flags, clock = _SLOT.unpack_from(self.mm, _HEADER.size + i * _SLOT.size)
        if length > PACK_MAX or offset > DATA_MAX:
            return h, 0, 0, flags, clock  # no pread takes 2**63
        return h, offset, length, flags, clock

    def free(self, h: int) -> int:
        """The first empty slot of ``h``'s chain, or -1 if there is none (a full index: its
        header's used count was damaged)."""
        mm, mask = self.mm, self.mask
        i = (h >> 4) & mask
        for _ in range(self.slots):
            if _HASH.unpack_from(mm, _HEADER.size + i * _SLOT.size)[0] == _EMPTY:
                return int(i)
            i = (i + 1) & mask
        return -1

    def insert(self, i: int, h: int, offset: int, length: int, clock: int) -> None:
        """Fill slot ``i`` (:meth:`free`) with ``h``'s record; the hash goes in last (readers)."""
        mm = self.mm
        at = _HEADER.size + i * _SLOT.size
        mm[at + 8 : at + _SLOT.size] = _SLOT.pack(0, offset, length, 0, clock)[8:]
        _HASH.pack_into(mm, at, h)

    def kill(self, i: int) -> None:
        _HASH.pack_into(self.mm, _HEADER.size + i * _SLOT.size, _TOMB)

    def touch(self, i: int, clock: int) -> None:
        _CLOCK.pack_into(self.mm, _HEADER.size + i * _SLOT.size + _CLOCK_AT, clock)

    def live(self) -> Iterator[tuple[int, int, int, int, int]]:
        """``(slot, hash, offset, length, clock)`` of every live slot."""
        for i, (h, offset, length, _flags, clock) in enumerate(
            _SLOT.iter_unpack(self.mm[_HEADER.size : _HEADER.size + self.slots * _SLOT.size])
        ):
            if h > _TOMB:
                if length > PACK_MAX or offset > DATA_MAX:
                    offset = length = 0
                yield i, h, offset, length, clock

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close bound now: __del__ may run at interpreter exit, after os is gone.
        if self.data >= 0:
            with contextlib.suppress(BufferError):  # a view still exported: freed with it
                self.mm.close()
            _close(self.data)
            self.data = -1

    def __del__(self) -> None:
        self.close()
