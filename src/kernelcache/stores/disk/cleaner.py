"""Eviction on a network filesystem: chosen outside the tier's space lock, removed in short holds.

On local disk :meth:`Space.clean` evicts while the put that went over the
cap still holds the space lock (a few hundred microseconds). On NFS every
one of its ~175 file operations for 10 victims (16 queue files loaded and
saved, a validation per candidate, two renames per victim) is a round trip
to the server, and every writer on every node would queue behind it
(issue 22 measured ~250 round trips held at 2 ms each).

So on a network filesystem the put only notes that the tier is over; after
it has released the space lock, one cleaner at a time (a lease lock file,
``v1/locks/cleaner.lease``) merges the LRU queues and validates candidates
without the space lock, then takes the space lock once per batch just to
rename the victims away (re-checked by inode, as on local disk) and update
the counter. A batch is sized from the candidates' own sizes to bring the
tier to ``LOW_WATER``; extraction folders of gone entries found by a
rescan are removed in the next batch, after checking under the lock that
their entry is still gone.

A candidate used between its validation and its batch may still be evicted
(it was the least recently used a moment before): LRU order is kept to
within one batch, never correctness.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from kernelcache.errors import StoreError
from kernelcache.stores.base import is_valid_key
from kernelcache.stores.disk.layout import scan_shard, shard_of
from kernelcache.stores.lockfile import FileFlightLock

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from kernelcache.stores.disk.layout import Layout
    from kernelcache.stores.disk.lru import Candidate, Queues, Record


class Tally(Protocol):
    """The space counter while its lock is held (:class:`.space.Tally`)."""

    def add(self, delta_bytes: int, delta_entries: int) -> None: ...


class Space(Protocol):
    """What the cleaner needs of the tier's :class:`.space.Space` (a protocol: no import
    cycle; the counter is its own :class:`.space.Tally`)."""

    layout: Layout
    queues: Queues

    def locked(self) -> AbstractContextManager[Tally]: ...

    def excess(self, tally: Any) -> tuple[int, int]: ...

    def above_target(self, tally: Any) -> bool: ...

    def recount_locked(self, tally: Any) -> tuple[int, int]: ...

    def remove_locked(self, tally: Any, key: str, shard: str, expect_ino: int | None) -> bool: ...

    def take_folder(self, folder: str) -> int: ...

    def count_event(self, name: str, amount: int) -> None: ...


#: How long a change waits for another process's cleaning before it cleans itself.
CLEAN_WAIT = 60.0


class Cleaner:
    """Evicts for one :class:`Space` on a network filesystem (see the module docstring)."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self._local = threading.local()  # this thread is cleaning: no cleaning from within
        self._orphans: list[tuple[str, str]] = []  # (shard, extraction folder)

    def request(self) -> None:
        """Note (under the space lock) that the tier went over a cap: :meth:`after_lock` cleans."""
        self._local.requested = True

    def after_lock(self) -> None:
        """Clean if this thread's last change asked for it (and is not itself the cleaning)."""
        local = self._local
        if getattr(local, "requested", False) and not getattr(local, "active", False):
            local.requested = False
            self.run()

    def run(self) -> None:
        """Evict down to ``LOW_WATER`` unless the tier is below its caps by now."""
        space = self.space
        lock = FileFlightLock(f"{space.layout.locks}/cleaner.lock", leases=True)
        try:
            if not lock.acquire(CLEAN_WAIT):
                return  # a cleaner elsewhere is stuck: the next change tries again
        except StoreError:
            space.count_event("errors", 1)
            return
        self._local.active = True
        try:
            for _pass in range(2):
                if self._pass():
                    return
                # Out of candidates while still over: recount (the counter was high).
                with space.locked() as tally:
                    space.recount_locked(tally)
                    if not space.above_target(tally):
                        return
        except OSError:
            space.count_event("errors", 1)
        finally:
            self._local.active = False
            lock.release()

    def _pass(self) -> bool:
        """One merge over the queues; ``True`` once the tier is at its target."""
        with self.space.locked() as tally:
            excess = self.space.excess(tally)
        if excess == (0, 0):
            return True
        candidates = self.space.queues.oldest(self._rescan)
        try:
            while True:
                batch = list(self._batch(candidates, excess))
                with self.space.locked() as tally:
                    self._remove(tally, batch)
                    excess = self.space.excess(tally)
                if excess == (0, 0):
                    return True
                if not batch:
                    return False
        finally:
            candidates.close()

    def _batch(
        self, candidates: Iterator[Candidate], excess: tuple[int, int]
    ) -> Iterator[tuple[Candidate, int]]:
        """Valid candidates (still the file the queue saw) until their sizes cover ``excess``."""
        need_bytes, need_entries = excess
        for candidate in candidates:
            if not is_valid_key(candidate.key) or shard_of(candidate.key) != candidate.shard:
                continue  # a damaged queue record: it must never name a path outside the shard
            path = self.space.layout.entry_path(candidate.key, candidate.shard)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if st.st_ino != candidate.ino or st.st_mtime_ns != candidate.mtime_ns:
                continue  # used or replaced since the scan
            yield candidate, st.st_size
            need_bytes -= st.st_size
            need_entries -= 1
            if need_bytes <= 0 and need_entries <= 0:
                return

    def _remove(self, tally: Tally, batch: list[tuple[Candidate, int]]) -> None:
        space = self.space
        orphans, self._orphans = self._orphans, []
        for shard, folder in orphans:
            key = os.path.basename(folder)
            if not os.path.lexists(space.layout.entry_path(key, shard)):
                tally.add(-space.take_folder(folder), 0)  # its entry is still gone
        for candidate, _size in batch:
            if space.remove_locked(tally, candidate.key, candidate.shard, candidate.ino):
                space.count_event("evictions", 1)

    def _rescan(self, shard: str) -> list[Record]:
        found, orphans = scan_shard(self.space.layout, shard)
        self._orphans.extend((shard, folder) for folder in orphans)
        return [(f.st.st_mtime_ns, f.st.st_ino, f.key) for f in found]
