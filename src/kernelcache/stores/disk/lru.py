"""The least recently used entries of the whole disk tier, without scanning it per put.

An entry's last use is its file's mtime (a put writes it, a hit refreshes it).
Each shard ``s`` has a queue file ``v1/lru/<s>``: its entries as one scan of
the shard saw them, oldest first, plus the time that scan started (its
*horizon*). Every entry of the shard that is not in its queue was written or
used after the horizon, so the queue's first record still valid (same inode,
same mtime) is the shard's least recently used entry, and the oldest head
over all shards is the tier's.

Cleaning (:meth:`Queues.oldest`) merges the shards' heads. A shard whose
queue is used up stands in the merge at its horizon: only when every head
is newer than that does its shard get scanned again (1/16 of the tier).
So eviction follows least-recent use across the whole tier, and each entry
is scanned about once per turnover of its shard, not once per put.

Records are consumed as they are handed out; the position is kept in the
file's header. Queue files are written by one cleaner at a time (the caller
holds the tier's space lock); a lost or damaged file only costs a rescan.
"""

from __future__ import annotations

import heapq
import os
import struct
import time
from typing import TYPE_CHECKING

from kernelcache import _fs

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence

    #: A path as its open folder and its name (``Layout.at``).
    At = Callable[[str], tuple[int | None, str]]

    #: A shard's entries as a scan saw them: (mtime_ns, inode, key).
    Record = tuple[int, int, str]

MAGIC = b"KCLRU\x00\x00\x01"
_HEADER = struct.Struct("<8sqQ")  # magic, horizon (ns), offset of the first unconsumed record
_RECORD = struct.Struct("<qQB")  # mtime (ns), inode, key length; then the key (ASCII)
_CHUNK = 16384
_UNSCANNED = -1  # the horizon of a shard never scanned: it is scanned first


class Candidate:
    """An entry that may be the least recently used: valid if its file still has this
    inode and mtime (a hit or a new put since the scan makes it newer than the horizon)."""

    __slots__ = ("ino", "key", "mtime_ns", "shard")

    def __init__(self, key: str, shard: str, ino: int, mtime_ns: int) -> None:
        self.key = key
        self.shard = shard
        self.ino = ino
        self.mtime_ns = mtime_ns

    def __repr__(self) -> str:
        return f"Candidate({self.key!r}, shard={self.shard}, mtime_ns={self.mtime_ns})"


class _Queue:
    """One shard's queue file, read forward in chunks."""

    def __init__(self, path: str, shard: str, at: At | None = None) -> None:
        self.path = path
        self.shard = shard
        self._at = at
        self.horizon = _UNSCANNED
        self.consumed = 0  # file offset after the last record handed out
        self._saved = 0
        self._fd: int | None = None
        self._buf = b""
        self._buf_at = 0  # file offset of _buf[0]
        self._next = 0  # file offset of the next record to parse
        self._size = 0
        self.rescanned = False

    def load(self) -> None:
        # Relative to the open lru folder: each cleaning loads every shard's queue, and on
        # a network filesystem each folder of a path walked is a lookup (issue 40).
        folder, name = (None, self.path) if self._at is None else self._at(self.path)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=folder)
        except OSError:  # missing, or a link (never followed): replaced by the next scan
            return
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) == _HEADER.size:
            magic, horizon, pos = _HEADER.unpack(head)
            if magic == MAGIC and _HEADER.size <= pos <= size:
                self._fd, self._size, self.horizon = fd, size, horizon
                self.consumed = self._saved = self._next = self._buf_at = pos
                return
        os.close(fd)  # damaged: as if missing

    def next(self) -> Candidate | None:
        """The next record, or ``None`` when the queue is used up (or unreadable)."""
        if self._fd is None or self._next >= self._size:
            return None
        at = self._next - self._buf_at
        if at + _RECORD.size > len(self._buf) or (
            at + _RECORD.size + self._buf[at + _RECORD.size - 1] > len(self._buf)
        ):
            self._buf = os.pread(self._fd, _CHUNK, self._next)
            self._buf_at, at = self._next, 0
        try:
            mtime_ns, ino, length = _RECORD.unpack_from(self._buf, at)
            key = self._buf[at + _RECORD.size : at + _RECORD.size + length].decode("ascii")
        except (struct.error, UnicodeDecodeError):
            self._size = self._next  # damaged from here on: used up, rescanned when needed
            return None
        if len(key) != length or not key:
            self._size = self._next
            return None
        self._next += _RECORD.size + length
        return Candidate(key, self.shard, ino, mtime_ns)

    def replace(self, records: Sequence[Record], horizon: int, staging: str) -> None:
        """Write a new queue of ``records`` (oldest first) taken at ``horizon``."""
        self.close()
        parts = [_HEADER.pack(MAGIC, horizon, _HEADER.size)]
        for mtime_ns, ino, key in records:
            raw = key.encode("ascii")
            parts.append(_RECORD.pack(mtime_ns, ino, len(raw)) + raw)
        _fs.write_atomic(self.path, b"".join(parts), staging=staging)
        self.horizon = horizon
        self.load()

    def save(self) -> None:
        """Record how far the queue was consumed (an offset, written in place)."""
        if self._fd is not None and self.consumed != self._saved:
            # Lost if we crash first: the records are handed out again, found stale, skipped.
            os.pwrite(self._fd, struct.pack("<Q", self.consumed), _HEADER.size - 8)
            self._saved = self.consumed

    def close(self) -> None:
        fd, self._fd = self._fd, None  # never a closed number held: a signal between
        if fd is not None:  # the two steps would close it again (EBADF), or another's file
            os.close(fd)
        self._buf, self._size = b"", 0


class Queues:
    """The queue files of every shard under ``folder`` (``v1/lru``)."""

    def __init__(
        self, folder: str, shards: Sequence[str], staging: str, at: At | None = None
    ) -> None:
        self._folder = folder
        self._shards = shards
        self._staging = staging
        self._at = at

    def oldest(self, rescan: Callable[[str], list[Record]]) -> Generator[Candidate, None, None]:
        """Candidates for eviction, least recently used first, over the whole tier.

        ``rescan(shard)`` lists a shard's entries when its queue is used up and
        its horizon is reached. The caller checks each candidate against the
        entry's file (a candidate used or replaced since the scan is skipped)
        and stops pulling when it has freed enough; what it pulled is
        consumed. Each shard is scanned at most once per call.
        """
        queues = {s: _Queue(f"{self._folder}/{s}", s, self._at) for s in self._shards}
        heap: list[tuple[int, int, str, Candidate | None]] = []

        def push(queue: _Queue) -> None:
            candidate = queue.next()
            if candidate is not None:
                heapq.heappush(heap, (candidate.mtime_ns, 1, queue.shard, candidate))
            elif not queue.rescanned:
                # Used up: entries newer than the horizon are unknown until a rescan.
                heapq.heappush(heap, (queue.horizon, 0, queue.shard, None))

        try:
            for queue in queues.values():
                queue.load()
                push(queue)
            while heap:
                _time, _kind, shard, candidate = heapq.heappop(heap)
                queue = queues[shard]
                if candidate is None:
                    horizon = time.time_ns()
                    records = sorted(rescan(shard))
                    queue.replace(records, horizon, self._staging)
                    queue.rescanned = True
                else:
                    # Consumed once handed out (before the yield: the caller may stop here).
                    queue.consumed += _RECORD.size + len(candidate.key)
                    yield candidate
                push(queue)
        finally:
            for queue in queues.values():
                try:
                    queue.save()
                finally:
                    queue.close()
