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

The cleaning runs in a thread of its own (one per store at a time), so the
change that asked for it returns at once: its caller, and whoever waits on
its single-flight lock, do not wait for the eviction (issue 40). At exit a
process lets a running cleaner finish (a bounded wait), so that it leaves no
lease behind for others to wait out. Nobody waits for a cleaner (issue 40: at 2 ms per request, eight processes
queueing for the cleaner's lease stalled a caller 15 s): a change that finds
another process cleaning goes on, and asks again at its next change; and a
cleaner hands over after :data:`CLEAN_BUDGET` seconds of batches, leaving the
rest to the next change that goes over. The tier may then stay over its cap
until that change, by what the changes made meanwhile.

A candidate used between its validation and its batch may still be evicted
(it was the least recently used a moment before): LRU order is kept to
within one batch, never correctness.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
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


#: Seconds of batches a cleaner runs before it hands over (see the module docstring).
CLEAN_BUDGET = 1.0
#: Victims removed per hold of the space lock: short holds, whatever the excess.
BATCH_MAX = 6
#: How long a process at exit waits for its running cleaners.
EXIT_WAIT = 10.0
#: Cleaner threads running now, joined at exit.
_running: set[threading.Thread] = set()


@atexit.register
def finish() -> None:
    """Wait (at most :data:`EXIT_WAIT` seconds) for the cleaners running in this process."""
    deadline = time.monotonic() + EXIT_WAIT
    for thread in list(_running):
        thread.join(max(0.0, deadline - time.monotonic()))


class Cleaner:
    """Evicts for one :class:`Space` on a network filesystem (see the module docstring)."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self._local = threading.local()  # this thread is cleaning: no cleaning from within
        self._orphans: list[tuple[str, str]] = []  # (shard, extraction folder)
        self._thread: threading.Thread | None = None
        self._again = False
        self._guard = threading.Lock()

    @property
    def pending(self) -> bool:
        """Whether this thread's next change cleans (it asked, or found another cleaning)."""
        return bool(getattr(self._local, "requested", False))

    def request(self) -> None:
        """Note (under the space lock) that the tier went over a cap: :meth:`after_lock` cleans."""
        self._local.requested = True

    def after_lock(self) -> None:
        """Clean if this thread's last change asked for it (and is not itself the cleaning)."""
        local = self._local
        if getattr(local, "requested", False) and not getattr(local, "active", False):
            local.requested = False
            self._start()

    def _start(self) -> None:
        """Run :meth:`run` in this store's cleaner thread (once more if it runs now)."""
        with self._guard:
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return
            thread = threading.Thread(target=self._loop, name="kernelcache-cleaner", daemon=True)
            self._thread, self._again = thread, False
            _running.add(thread)
        thread.start()

    def wait(self) -> bool:
        """Let this store's running cleaner finish (at most :data:`EXIT_WAIT` seconds);
        whether none runs now. It names its files relative to the tier's open folders,
        which closing the store closes: not while it still runs (``DiskStore.close``)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(EXIT_WAIT)
        return not thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                self.run()
                with self._guard:
                    if not self._again:
                        return
                    self._again = False
        finally:
            _running.discard(threading.current_thread())

    def run(self) -> None:
        """Evict down to ``LOW_WATER`` unless the tier is below its caps by now."""
        space = self.space
        layout = space.layout
        try:
            lock = FileFlightLock(
                f"{layout.locks}/cleaner.lock", leases=True, dir_fd=layout.folder_fd(layout.locks)
            )
            if not lock.acquire(0.0):
                self._local.requested = True  # another cleans now: ask again next change
                return
        except (StoreError, OSError):
            space.count_event("errors", 1)
            return
        self._local.active = True
        deadline = time.monotonic() + CLEAN_BUDGET
        try:
            for _pass in range(2):
                done = self._pass(deadline)
                if done is None:
                    self._local.requested = True  # handed over: the next change goes on
                    return
                if done:
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

    def _pass(self, deadline: float) -> bool | None:
        """One merge over the queues; ``True`` once the tier is at its target, ``None``
        when ``deadline`` passed first (handed over)."""
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
                if time.monotonic() >= deadline:
                    return None
        finally:
            candidates.close()

    def _batch(
        self, candidates: Iterator[Candidate], excess: tuple[int, int]
    ) -> Iterator[tuple[Candidate, int]]:
        """Valid candidates (still the file the queue saw) until their sizes cover ``excess``,
        at most :data:`BATCH_MAX` of them."""
        need_bytes, need_entries = excess
        taken = 0
        for candidate in candidates:
            if not is_valid_key(candidate.key) or shard_of(candidate.key) != candidate.shard:
                continue  # a damaged queue record: it must never name a path outside the shard
            folder, name = self.space.layout.at(
                self.space.layout.entry_path(candidate.key, candidate.shard)
            )
            try:
                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_ino != candidate.ino or st.st_mtime_ns != candidate.mtime_ns:
                continue  # used or replaced since the scan
            yield candidate, st.st_size
            need_bytes -= st.st_size
            need_entries -= 1
            taken += 1
            if (need_bytes <= 0 and need_entries <= 0) or taken >= BATCH_MAX:
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
        return [(f.clock_ns, f.ino, f.key) for f in found]
