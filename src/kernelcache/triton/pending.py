"""A Triton group being compiled: its staged files and its claim, from get_group's miss to put_group.

``triton.compile`` asks ``get_group``; on a miss it compiles, ``put``\\ s every
stage and ``put_group``\\ s the group: several calls on one manager, and the
compile may raise in between. The miss takes the key's claim
(:meth:`kernelcache.Cache.claim`: this process's flight, the disk tier's lock
file, then the Redis lease), so the other threads, processes and machines
asking for the same kernel wait, look again and hit instead of compiling it
once more (PyTorch #108971: every rank compiling the same kernel).

The claim is released at ``put_group``, which publishes the group (waiters
wake and hit; ``compile_seconds`` is recorded), and otherwise at the first of:

- the manager being collected without ``put_group`` (the compile raised and
  Triton dropped its manager),
- interpreter exit,
- ``timeout`` seconds after it was taken, whatever the holder is doing: a
  manager kept alive by a stored traceback must not block the others for long.

A SIGKILLed holder's lock file dies with it and its lease expires. Liveness
beats deduplication: once the holder gives up, a waiter compiles.

Only the process that took a claim publishes through it or releases it: a
forked child inherits the object and its finalizer, but not the claim.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.singleflight import Claim
from kernelcache.triton.config import count

STAGING_PREFIX = "kernelcache-triton-"

# Claims held by this process, by (cache, key): a thread asking again for a key
# it already holds has left that compile behind (it raised, and a traceback
# keeps its manager alive), so the old claim is abandoned rather than waited
# for, which would be a wait for ourselves.
_leading: dict[tuple[int, str], PendingGroup] = {}
_leading_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _leading_lock
    _leading_lock = threading.Lock()
    _leading.clear()  # the parent's claims: never the child's to release


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Reaper:
    """Releases what managers left behind when they were dropped.

    A manager freed by reference counting (Triton's compile raised and its
    frame went) is released at once, in that thread. One freed by the cyclic
    collector must not be: a collection runs inside whatever allocation set
    it off, possibly while this very thread holds a lock that releasing a
    claim takes (the cache's flight table, the lock files' registry), and
    those locks are not reentrant. So a release that finds a collection
    running is queued (``SimpleQueue.put`` is safe there) for a thread of its
    own; what is still queued at exit is released then.
    """

    def __init__(self) -> None:
        self.collecting = threading.local()
        self.queue: queue.SimpleQueue[PendingGroup] = queue.SimpleQueue()
        self.pid: int | None = None
        gc.callbacks.append(self._gc_phase)

    def _gc_phase(self, phase: str, info: dict[str, Any]) -> None:
        self.collecting.active = phase == "start"

    def start(self) -> None:
        """Make sure this process has its thread (called from ordinary code, never from a collection)."""
        if self.pid != os.getpid():  # first use, or a forked child: the parent's thread is not here
            self.pid = os.getpid()
            self.queue = queue.SimpleQueue()
            threading.Thread(
                target=self._run, name="kernelcache-triton-reaper", daemon=True
            ).start()

    def release(self, pending: PendingGroup) -> None:
        """The finalizer of a manager with a pending group."""
        if getattr(self.collecting, "active", False):
            self.queue.put(pending)
        else:
            pending.release()

    def drain(self) -> None:
        while True:
            try:
                self.queue.get_nowait().release()
            except queue.Empty:
                return

    def _run(self) -> None:
        jobs = self.queue
        while True:
            jobs.get().release()


_reaper = _Reaper()
atexit.register(_reaper.drain)


def claim(cache: Cache, key: str, timeout: float) -> Claim:
    """``cache.claim(key)``, after abandoning a claim on ``key`` this thread left behind."""
    with _leading_lock:
        stale = _leading.get((id(cache), key))
    if stale is not None and stale.thread == threading.get_ident():
        stale.abandon("claims_abandoned")
    return cache.claim(key, timeout=timeout)


class PendingGroup:
    """The files one manager staged for a group, and the claim it holds while compiling it.

    ``owner`` is the manager: when it is collected, the claim is abandoned and
    the staging directory removed. Thread-safe where it matters: the timer
    may expire the claim while the owner publishes.
    """

    def __init__(self, owner: object, cache: Cache, claim: Claim | None, timeout: float) -> None:
        self.cache = cache
        self.thread = threading.get_ident()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._claim = claim
        self._started = time.perf_counter()
        self._stage_dir: str | None = None
        self._staged: dict[str, str] = {}
        self._timer: threading.Timer | None = None
        # Runs when the manager is collected, and at exit for one still alive.
        _reaper.start()
        self._finalizer = weakref.finalize(owner, _reaper.release, self)
        if claim is not None:
            with _leading_lock:
                _leading[(id(cache), claim.key)] = self
            if math.isfinite(timeout):
                self._timer = threading.Timer(timeout, self.abandon, args=("claims_expired",))
                self._timer.name = "kernelcache-triton-claim"
                self._timer.daemon = True
                self._timer.start()

    def __repr__(self) -> str:
        return f"PendingGroup(claim={self._claim!r}, staged={sorted(self._staged)})"

    # Staged files ------------------------------------------------------
    def staged(self, filename: str) -> str | None:
        return self._staged.get(filename)

    def stage(self, filename: str, raw: bytes) -> str:
        """Write one stage's file to this group's private directory; returns its path."""
        if self._stage_dir is None:
            # One directory per compile (mode 0700), removed when it ends: a
            # directory per process was never removed by forked workers,
            # which leave through os._exit and skip atexit.
            self._stage_dir = tempfile.mkdtemp(prefix=STAGING_PREFIX)
        # Nothing else reads it: no temp-and-rename needed (a failed write raises to Triton).
        path = os.path.join(self._stage_dir, filename)
        with open(path, "wb") as f:
            f.write(raw)
        self._staged[filename] = path
        return path

    # Ending ------------------------------------------------------------
    def publish(self, key: str, entry: Entry) -> Entry:
        """Store the compiled group; through the claim if this process still holds it."""
        try:
            held = self._take_claim()
            if held is not None and held.leads and held.key == key:
                # Wakes the waiters; compile_seconds: from the claim to now.
                return held.publish(entry)
            if held is not None:
                self._give_up(held, "claims_abandoned")
            seconds = round(time.perf_counter() - self._started, 6)
            return self.cache.put(key, entry.with_meta(compile_seconds=seconds))
        finally:
            self.release()

    def abandon(self, counter: str) -> None:
        """Give the claim up (the waiters go on); counted as ``counter``. Idempotent."""
        held = self._take_claim()
        if held is not None:
            self._give_up(held, counter)

    @staticmethod
    def _give_up(held: Claim, counter: str) -> None:
        if held.leads:
            held.abandon()
            count(counter)

    def release(self) -> None:
        """Abandon the claim if still held, stop the timer, remove the staged files. Idempotent."""
        if os.getpid() != self._pid:
            return  # inherited through fork: the parent's claim and files
        self.abandon("claims_abandoned")
        if self._timer is not None:
            self._timer.cancel()
        stage_dir, self._stage_dir, self._staged = self._stage_dir, None, {}
        if stage_dir is not None:
            shutil.rmtree(stage_dir, ignore_errors=True)
        self._finalizer.detach()

    def _take_claim(self) -> Claim | None:
        """The claim, now no longer this object's (so exactly one caller ends it)."""
        if os.getpid() != self._pid:
            return None
        with self._lock:
            held, self._claim = self._claim, None
        if held is not None:
            with _leading_lock:
                if _leading.get((id(self.cache), held.key)) is self:
                    del _leading[(id(self.cache), held.key)]
        return held
