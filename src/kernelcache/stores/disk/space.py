"""The disk tier's space: one counter for the whole tier, its lock, removal and eviction.

``v1/space`` holds the bytes (entry files plus extracted copies) and the
entry count of the whole tier, with a checksum. Every change to the tree's
contents happens under its lock: a put publishes (renames) its
entry and adds its size, a removal renames the entry away and subtracts
what it freed, an extraction adds its copies. So the counter is exact, a put
never scans the cache, and the cap is checked against the whole tier.

Crash safety: additions are counted before the change and subtractions
after it, so a process killed in between leaves the counter high, never
low: the tier may keep less than its cap, never more. A missing or damaged
counter file (deleted, cut, replaced by garbage or a symlink) is rebuilt
by a full recount before anything is added to it.

The lock is :mod:`.tierlock` (``flock``, or a lease on a network filesystem,
where new entries are published with ``link()``: :mod:`.netpublish`).

Eviction (:meth:`Space.clean`) runs when a change takes the tier over a cap
(on a network filesystem after the lock is released: :mod:`.cleaner`):
least recently used entries of the whole tier (:mod:`.lru`) are removed,
each by a rename into staging and an inode check (an entry published after
the eviction chose its victim is put back), until the tier is at
``LOW_WATER`` of its caps.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
from typing import TYPE_CHECKING

import xxhash

from kernelcache.stores.base import is_valid_key
from kernelcache.stores.disk.cleaner import Cleaner
from kernelcache.stores.disk.layout import (
    Found,
    Layout,
    remove_tree,
    scan_shard,
    shard_of,
    shards,
    tree_size,
)
from kernelcache.stores.disk.lru import Queues
from kernelcache.stores.disk.netpublish import (
    link_in,
    lstat_fresh,
    probe,
    replace_counted,
    replaced,
)
from kernelcache.stores.disk.tierlock import TierLock

_log = logging.getLogger("kernelcache")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kernelcache.stores.disk.lru import Candidate, Record
    from kernelcache.stores.disk.pack import Packs

#: Eviction stops at this fraction of each cap. Near 1, so that a full tier
#: keeps nearly all of its cap; cleaning runs about once per 1 % of the cap written.
LOW_WATER = 0.99
#: On a network filesystem eviction goes further down: each cleaning loads the 16
#: queue files (a round trip per request there), so it should run once per tenth of the
#: cap written, not at every put past the cap (issue 40).
NETWORK_LOW_WATER = 0.9
_MAGIC = b"KCSPACE1"
_TALLY = struct.Struct("<8sqqQ")  # magic, bytes, entries, xxh64 of the fields before it
_OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
#: Staged deletions that failed (EBUSY) remembered for a retry, at most.
_LEFTOVER_MAX = 1024


def _pack(size: int, count: int) -> bytes:
    body = struct.pack("<8sqq", _MAGIC, size, count)
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def parse_tally(raw: bytes) -> tuple[int, int] | None:
    """``(bytes, entries)`` from a counter file's bytes, or ``None`` if it is not intact."""
    if len(raw) != _TALLY.size:
        return None
    magic, size, count, check = _TALLY.unpack(raw)
    if magic != _MAGIC or check != xxhash.xxh64_intdigest(raw[:-8]) or size < 0 or count < 0:
        return None
    return size, count


class Tally:
    """The counter while its lock is held: read once, written on each change."""

    __slots__ = ("bytes", "entries", "fd", "valid")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        parsed = parse_tally(os.pread(fd, _TALLY.size, 0))
        self.valid = parsed is not None
        self.bytes, self.entries = parsed or (0, 0)

    def add(self, delta_bytes: int, delta_entries: int) -> None:
        if delta_bytes or delta_entries:  # a same-size replacement writes nothing
            self.set(self.bytes + delta_bytes, self.entries + delta_entries)

    def set(self, size: int, count: int) -> None:
        self.bytes, self.entries = max(0, size), max(0, count)
        os.pwrite(self.fd, _pack(self.bytes, self.entries), 0)
        self.valid = True


class Space:
    """Counter, lock, removals and eviction of one disk tier (see the module docstring).

    ``count(name, n)`` records an event in the store's counters; ``caps()``
    gives ``(max_bytes, max_entries)`` at each check, so a cap changed on an
    open store applies from its next change.
    """

    def __init__(
        self,
        layout: Layout,
        count: Callable[[str, int], None],
        caps: Callable[[], tuple[int | None, int | None]],
        *,
        network: bool = False,
    ) -> None:
        self.layout = layout
        self.queues = Queues(layout.lru, shards(), layout.staging, layout.at)
        self._count = count
        self._caps = caps
        self.lock = TierLock(layout, network=network)
        self.cleaner = Cleaner(self)
        #: Small entries' packs (local filesystems only; set by the store): see pack.py.
        self.packs: Packs | None = None
        self._pid = os.getpid()
        self._doomed: list[str] = []
        self._leftover: list[str] = []

    # The lock ------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[Tally]:
        """Hold the tier's space lock; yields the counter (recounted first if it was lost).

        What was renamed into staging meanwhile is deleted after the lock is
        released (nobody waits for the deletions); a folder that cannot go now
        (``EBUSY``: a file in it still open on another NFS client) is retried
        after a later change, and swept by the next store open.
        """
        if self._pid != os.getpid():
            self._pid, self._doomed, self._leftover = os.getpid(), [], []
        doomed: list[str] = []
        try:
            with self.lock.held() as fd:
                try:
                    tally = Tally(fd)
                    if not tally.valid:
                        self.recount_locked(tally)
                    yield tally
                finally:
                    doomed, self._doomed = self._doomed, []
        finally:
            pending, self._leftover = self._leftover + doomed, []
            self._leftover = [p for p in pending if not remove_tree(p, self.layout.at)][
                :_LEFTOVER_MAX
            ]
        self.cleaner.after_lock()  # network filesystems: eviction outside the lock

    def discard(self, path: str) -> None:
        """Delete ``path`` in staging now, or after a later change if it cannot go now."""
        if not remove_tree(path, self.layout.at) and len(self._leftover) < _LEFTOVER_MAX:
            self._leftover.append(path)

    # Changes -------------------------------------------------------------
    def scan(self, shard: str) -> tuple[list[Found], list[str]]:
        """:func:`.layout.scan_shard` with the shard's packed records."""
        packed = () if self.packs is None else self.packs.found(shard)
        return scan_shard(self.layout, shard, packed)

    def publish(self, tmp: str, key: str, shard: str, size: int) -> None:
        """Rename the staged entry ``tmp`` into place, count it, evict if over a cap."""
        path = self.layout.entry_path(key, shard)
        with self.locked() as tally:
            if self.lock.network:
                link_in(tally, tmp, path, size, self.discard, self.layout.at)
                self.clean(tally)
                return
            try:
                old, new = replaced(os.lstat(path))
            except FileNotFoundError:
                old, new = 0, 1
            replace_counted(tally, tmp, path, size, old, new)
            if self.packs is not None:  # a packed version of the key goes: one entry per key
                self._unpack(tally, key, shard, replacing=True)
            self.clean(tally)

    def publish_packed(self, key: str, shard: str, parts: list[bytes], size: int) -> None:
        """Append ``key``'s packed entry to its shard's pack (:mod:`.pack`), count it, evict if
        over a cap. An entry file of the key (a put of a large version, a cache of 0.x's
        layout) is removed: the tier holds one entry per key."""
        assert self.packs is not None
        with self.locked() as tally:
            tally.add(size, 1)  # before the change: a crash leaves the counter high
            try:
                replaced = self.packs.append(key, shard, parts, size)
            except OSError:
                tally.add(-size, -1)  # nothing was published (the slot is filled last)
                raise
            if replaced >= 0:
                tally.add(-replaced, -1)
            self.remove_file_locked(tally, key, shard, None, replacing=True)
            self.tidy(shard)
            self.uncount_dropped(tally)
            self.clean(tally)

    def _unpack(
        self,
        tally: Tally,
        key: str,
        shard: str,
        expect_offset: int | None = None,
        expect_clock: int | None = None,
        *,
        replacing: bool = False,
        damaged: bool = False,
    ) -> bool:
        """Remove ``key``'s packed record and count it; its extracted copies go too unless
        it is ``replacing`` (a new version of the key: copies stay, as a file's replace
        leaves them, since paths handed out for the old version may be in use).
        ``damaged``: only if it fails verification now (:meth:`.pack.Packs.remove`)."""
        assert self.packs is not None
        freed = self.packs.remove(key, shard, expect_offset, expect_clock, damaged=damaged)
        if freed < 0:
            return False
        if not replacing:
            freed += self.take_folder(self.layout.key_folder(key, shard))
        tally.add(-freed, -1)
        if not replacing:  # an older file of the key a killed writer left goes too
            self.remove_file_locked(tally, key, shard, None, replacing=True)
        self.tidy(shard)
        self.uncount_dropped(tally)
        return True

    def tidy(self, shard: str) -> None:
        """Compact ``shard``'s pack if removals left it enough dead bytes; after the change
        was counted, so a failure (a full disk) is counted and logged, never raised: the
        change it follows is done."""
        assert self.packs is not None
        try:
            self.packs.tidy(shard)
        except OSError as exc:
            self._count("errors", 1)
            _log.warning("kernelcache: cannot compact the pack of shard %s: %s", shard, exc)

    def uncount_dropped(self, tally: Tally) -> None:
        """Uncount the damaged records that compactions dropped (they were entries)."""
        assert self.packs is not None
        size, count = self.packs.take_dropped()
        if count:
            tally.add(-size, -count)

    def remove(
        self,
        key: str,
        expect_ino: int | None = None,
        expect_record: int | None = None,
        expect_clock: int | None = None,
    ) -> bool:
        """Remove ``key`` and its extracted copies, unless the file is no longer ``expect_ino``
        (a packed entry: unless its record is no longer at offset ``expect_record``, or was
        used or replaced since its last use ``expect_clock``)."""
        with self.locked() as tally:
            return self.remove_locked(
                tally, key, shard_of(key), expect_ino, expect_record, expect_clock
            )

    def remove_damaged(self, key: str, offset: int) -> bool:
        """Remove ``key``'s packed record at ``offset`` that a hit found damaged, if it is
        still there and still fails verification (the hit may have read its slot torn)."""
        with self.locked() as tally:
            assert self.packs is not None
            return self._unpack(tally, key, shard_of(key), offset, damaged=True)

    def remove_locked(
        self,
        tally: Tally,
        key: str,
        shard: str,
        expect_ino: int | None,
        expect_record: int | None = None,
        expect_clock: int | None = None,
    ) -> bool:
        """Remove an entry under the lock, a file or a packed record (``expect_ino`` 0)."""
        removed = False
        if self.packs is not None and expect_ino in (None, 0):
            removed = self._unpack(tally, key, shard, expect_record, expect_clock)
        if expect_ino != 0:
            removed = self.remove_file_locked(tally, key, shard, expect_ino) or removed
        return removed

    def remove_file_locked(
        self, tally: Tally, key: str, shard: str, expect_ino: int | None, *, replacing: bool = False
    ) -> bool:
        """Remove an entry file under the lock; the rename into staging makes the inode check
        look at the very file taken, so a newer entry is linked back and survives. Its
        extracted copies go too, unless it is ``replacing`` (see :meth:`_unpack`)."""
        # Renames never follow a link at the name itself; these make sure no link
        # stands at a directory above it either (replaced once per process).
        self.layout.shard_dir(self.layout.entries, shard, create=True)
        self.layout.shard_dir(self.layout.extracted, shard, create=True)
        path = self.layout.entry_path(key, shard)
        trash = self.layout.trash()
        # Relative to the open folders: one lookup per name on a network filesystem.
        # Not looked for again for a put's check for an older file of its key (rarely
        # there; a packed version shadows it): see _rename_away.
        if not self._rename_away(path, trash, again=not replacing):
            return False
        (src_fd, src), (dst_fd, dst) = self.layout.at(path), self.layout.at(trash)
        self._doomed.append(trash)
        # On a network filesystem the rename took the server's file, which this node's
        # name cache may not know yet (another node replaced the entry): ask the server.
        if self.lock.network:
            st = lstat_fresh(trash, self.layout.at)
        else:
            st = os.stat(dst, dir_fd=dst_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            self.layout.refused()  # a link or a folder where an entry belongs: junk, removed
            return False
        if not st.st_size and self.lock.network:
            return False  # a lookup probe's file (netpublish.probe): no entry, never counted
        if expect_ino is not None and st.st_ino != expect_ino:
            with contextlib.suppress(FileExistsError):  # EEXIST: an even newer entry is in place
                os.link(dst, src, src_dir_fd=dst_fd, dst_dir_fd=src_fd)
            return False
        freed = st.st_size
        if not replacing:
            freed += self.take_folder(self.layout.key_folder(key, shard))
        tally.add(-freed, -1)  # after the removal: a crash leaves it high, not low
        return True

    def probe(self, key: str) -> None:
        """Make this node see ``key``'s entry as the server has it (``DiskStore._revalidate``,
        :func:`.netpublish.probe`). Without the space lock (issue 40: a lease costs ~10
        round trips): the empty file it may make is no entry to a removal or a publish
        (never counted; a recount meanwhile counts it as an entry of 0 bytes: high, never
        low), and it checks afresh which file it removes."""
        probe(self.layout.entry_path(key), self.layout.trash, self.discard, self.layout.at)

    def _rename_away(self, path: str, trash: str, again: bool = True) -> bool:
        """Rename ``path`` to ``trash``, relative to the open folders (one lookup per name on
        a network filesystem); ``False`` if ``path`` is absent. With ``again``, a path not
        found relative to an open folder that was removed since (the shard made again by
        another process) is looked for once more, by what the names hold now."""
        while True:
            try:
                (src_fd, src), (dst_fd, dst) = self.layout.at(path), self.layout.at(trash)
                os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            except FileNotFoundError:  # no shard folder yet: absent as well
                if not again or not self.layout.forget_moved(path, trash):
                    return False
                again = False
            else:
                return True

    def take_folder(self, folder: str) -> int:
        """Rename ``folder`` into staging (deleted after the lock); its bytes, 0 if absent."""
        trash = self.layout.trash()
        if not self._rename_away(folder, trash):
            return 0
        self._doomed.append(trash)
        if not stat.S_ISDIR(os.lstat(trash).st_mode):
            self.layout.refused()
            return 0
        return tree_size(trash)

    def drop_folder(self, folder: str, expect_ino: int | None = None) -> None:
        """Remove an extraction folder found damaged (if it is still inode ``expect_ino``)
        and count the bytes freed."""
        with self.locked() as tally:
            if expect_ino is not None:
                try:
                    if os.lstat(folder).st_ino != expect_ino:
                        return  # replaced since it was examined: not the damaged one
                except FileNotFoundError:
                    return
            tally.add(-self.take_folder(folder), 0)

    def add_extraction(self, key: str, staged: str, tag: str, size: int) -> bool:
        """Move the folder ``staged`` into place as version ``tag`` of ``key``'s copies.

        Under the lock, so an eviction cannot take the entry meanwhile: the
        entry is marked used first (it is the newest, so the cleaning that
        the added bytes may start removes others), older versions of its
        copies go, and the bytes are counted. ``False`` (nothing placed) if
        the tier no longer holds the entry or another process placed it first.
        """
        shard = shard_of(key)
        entry = self.layout.entry_path(key, shard)
        with self.locked() as tally:
            try:
                if not stat.S_ISREG(os.lstat(entry).st_mode):
                    return False
                os.utime(entry, follow_symlinks=False)
            except FileNotFoundError:
                if self.packs is None or not self.packs.used(key, shard):
                    return False
            self.layout.shard_dir(self.layout.extracted, shard, create=True)
            folder = self.layout.key_folder(key, shard)
            self.layout.sub_folder(folder, create=True)
            freed = sum(
                self.take_folder(f"{folder}/{name}") for name in os.listdir(folder) if name != tag
            )
            tally.add(size - freed, 0)
            try:
                os.rename(staged, f"{folder}/{tag}")
            except OSError as exc:
                tally.add(-size, 0)
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    return False  # benign: another process extracted the same version first
                raise
            self.clean(tally)
        return True

    # Eviction ------------------------------------------------------------
    def over(self, tally: Tally) -> bool:
        """Whether the tier is over one of its caps."""
        max_bytes, max_entries = self._caps()
        return (max_bytes is not None and tally.bytes > max_bytes) or (
            max_entries is not None and tally.entries > max_entries
        )

    def above_target(self, tally: Tally) -> bool:
        """Whether the tier is above ``LOW_WATER`` of a cap (eviction goes on)."""
        return self.excess(tally) != (0, 0)

    def excess(self, tally: Tally) -> tuple[int, int]:
        """``(bytes, entries)`` by which the tier is above ``LOW_WATER`` of its caps
        (``NETWORK_LOW_WATER`` on a network filesystem)."""
        max_bytes, max_entries = self._caps()
        low = NETWORK_LOW_WATER if self.lock.network else LOW_WATER
        over_bytes = over_entries = 0
        if max_bytes is not None and tally.bytes > max_bytes * low:
            over_bytes = max(1, tally.bytes - int(max_bytes * low))
        if max_entries is not None:
            margin = max_entries // (10 if self.lock.network else 100)
            over_entries = max(0, tally.entries - (max_entries - margin))
        return over_bytes, over_entries

    def count_event(self, name: str, amount: int) -> None:
        """Record an event in the store's counters (``evictions``, ``errors``)."""
        self._count(name, amount)

    def clean(self, tally: Tally) -> None:
        """If the tier is over a cap, evict its least recently used entries to ``LOW_WATER``.

        Failures are counted, not raised: the put or extraction that started
        the cleaning has succeeded, and the next change cleans again.
        """
        if not self.over(tally):
            return
        if self.lock.network:
            self.cleaner.request()  # once the lock is released: see stores/disk/cleaner.py
            return
        try:
            self._evict(tally)
        except OSError:
            self._count("errors", 1)

    def _evict(self, tally: Tally) -> None:
        # A second pass only when the first ran out of candidates while still over:
        # the counter was high (a crash between counting and changing; the recount
        # fixes it), or entries were used while the pass ran (newer now, so last).
        for _pass in range(2):
            candidates = self.queues.oldest(lambda shard: self._rescan(tally, shard))
            try:
                while self.above_target(tally):
                    candidate = next(candidates, None)
                    if candidate is None:
                        break
                    self._evict_one(tally, candidate)
                else:
                    return
            finally:
                candidates.close()
            self.recount_locked(tally)

    def _evict_one(self, tally: Tally, candidate: Candidate) -> None:
        if not is_valid_key(candidate.key) or shard_of(candidate.key) != candidate.shard:
            return  # a damaged queue record: it must never name a path outside the shard
        if candidate.ino == 0:  # a packed entry (Found.ino): gone if unused since the scan
            freed = -1
            if self.packs is not None:
                freed = self.packs.evict(candidate.key, candidate.shard, candidate.mtime_ns)
            if freed >= 0:
                freed += self.take_folder(self.layout.key_folder(candidate.key, candidate.shard))
                tally.add(-freed, -1)
                self._count("evictions", 1)
                self.remove_file_locked(tally, candidate.key, candidate.shard, None, replacing=True)
                self.tidy(candidate.shard)
                self.uncount_dropped(tally)
            return
        path = self.layout.entry_path(candidate.key, candidate.shard)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # removed meanwhile
        if st.st_ino != candidate.ino or st.st_mtime_ns != candidate.mtime_ns:
            return  # used or replaced since the scan: newer than its record says
        if self.remove_locked(tally, candidate.key, candidate.shard, candidate.ino):
            self._count("evictions", 1)

    def _rescan(self, tally: Tally, shard: str) -> list[Record]:
        """A shard's entries for its queue; extraction folders of gone entries are removed."""
        found, orphans = self.scan(shard)
        for folder in orphans:
            tally.add(-self.take_folder(folder), 0)
        return [(f.clock_ns, f.ino, f.key) for f in found]

    def recount_locked(self, tally: Tally) -> tuple[int, int]:
        """Count the whole tier from its files (a full scan) and store the result."""
        size = count = 0
        for shard in shards():
            found, orphans = self.scan(shard)
            for folder in orphans:
                self.take_folder(folder)  # not counted below, so not subtracted either
            size += sum(f.size for f in found)
            count += len(found) + sum(1 for f in found if f.shadow)  # a shadow: counted as put
        tally.set(size, count)
        return count, size

    def recount(self) -> tuple[int, int]:
        """``(entries, bytes)`` counted from the files; the counter is set to them."""
        with self.locked() as tally:
            return self.recount_locked(tally)

    def usage(self, writable: bool) -> tuple[int, int]:
        """``(entries, bytes)`` from the counter; recounted if the counter is missing or damaged
        (a read-only tier counts without storing the result)."""
        try:
            fd = os.open(self.layout.space, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # missing, or a link (refused): recounted below
            parsed = None
        else:
            try:
                parsed = parse_tally(os.pread(fd, _TALLY.size, 0))
            finally:
                os.close(fd)
        if parsed is not None:
            return parsed[1], parsed[0]
        if writable:
            return self.recount()
        size = count = 0
        for shard in shards():
            found, _orphans = self.scan(shard)
            size += sum(f.size for f in found)
            count += len(found) + sum(1 for f in found if f.shadow)
        return count, size

    def drop_empty_packs(self) -> None:
        """Remove the packs that hold no entry any more (``clear``), and uncount them."""
        if self.packs is not None:
            with self.locked():
                self.packs.drop_empty()

    def close(self) -> bool:
        """Close the counter; whether no cleaner runs now (the open folders may go)."""
        idle = self.cleaner.wait()  # before the folders its requests are relative to
        self.lock.close()
        return idle
