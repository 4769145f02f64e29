"""Single-flight compiles: of many callers asking for one missing key, one compiles.

Three levels, each one admitting the next:

1. threads of one process: the first caller of a key leads, the others wait
   on its :class:`Flight` (an event) and take the entry it publishes;
2. processes and machines: the leader takes each tier's
   :meth:`~kernelcache.stores.base.Store.flight_lock` in tier order (the disk
   tier's lock file, then a remote tier's lease), looking in the tiers again
   after each lock, since whoever held it may have published the entry meanwhile.

Liveness beats deduplication: a waiter whose wait runs past ``timeout``
compiles itself. An exception in the compile function reaches the caller
that ran it; the waiters then start over and one of them compiles. Failures
are never cached. (PyTorch #108971: eight ranks compiling the same kernel.)
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.stores.base import FlightLock, Store

if TYPE_CHECKING:
    from kernelcache.cache import Cache

CompileFn = Callable[[], "Entry | bytes"]


class Flight:
    """One in-process compile of a key that other threads can wait for."""

    __slots__ = ("deadline", "done", "entry", "lock_deadline", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        now = time.monotonic()
        #: When the leader stops waiting for other processes' locks and compiles itself.
        self.lock_deadline = now + timeout
        # Waiters allow the leader its lock wait plus a full timeout for the compile:
        # giving up at the same moment as the leader would compile twice in one process.
        self.deadline = now + 2 * timeout
        self.done = threading.Event()
        self.entry: Entry | None = None  # None when done: the leader failed

    def publish(self, entry: Entry) -> None:
        """Hand the compiled entry to the waiters now, before it is stored.

        Threads of this process need not wait for the disk write; callers
        arriving until the flight lands get the entry from it too.
        """
        self.entry = entry
        self.done.set()

    def extend(self) -> None:
        """The leader started compiling: give waiters a full timeout for the compile itself."""
        self.deadline = time.monotonic() + self.timeout

    def wait(self) -> bool:
        """Wait until the leader finishes (``True``) or the deadline passes (``False``)."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return self.done.is_set()
            if self.done.wait(remaining):
                return True
            # The deadline may have been extended while we slept: look again.


class Flights:
    """The in-process table of keys being compiled."""

    def __init__(self) -> None:
        self._reset()
        _tables.add(self)

    def _reset(self) -> None:
        # A forked child has none of the parent's leader threads: waiting on
        # their flights would only run out the timeout. It starts empty.
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}

    def join(self, key: str, timeout: float) -> tuple[Flight, bool]:
        """The flight for ``key`` and whether the caller leads it (it had none)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = self._flights[key] = Flight(timeout)
            return flight, True

    def land(self, key: str, flight: Flight, entry: Entry | None) -> None:
        """End the leader's flight and wake its waiters if :meth:`Flight.publish` did not."""
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        if not flight.done.is_set():
            flight.entry = entry
            flight.done.set()


_tables: weakref.WeakSet[Flights] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for table in list(_tables):
        table._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_or_compile(cache: Cache, key: str, fn: CompileFn, timeout: float) -> Entry:
    """:meth:`Cache.get_or_compile` (see the module docstring for the protocol)."""
    while True:
        entry = cache.get(key)
        if entry is not None:
            return entry
        flight, leader = cache._flights.join(key, timeout)
        if leader:
            result: Entry | None = None
            try:
                result = _lead(cache, key, fn, flight)
            finally:
                cache._flights.land(key, flight, result)
            return result
        if not flight.wait():
            cache._stats.count("lock_timeouts")
            return compile_and_put(cache, key, fn)  # the leader is stuck: liveness first
        if flight.entry is not None:
            cache._stats.count("flight_waits")
            return flight.entry
        # The leader's compile raised: start over; one of the waiters leads next.


def _lead(cache: Cache, key: str, fn: CompileFn, flight: Flight) -> Entry:
    held: list[FlightLock] = []
    try:
        for index, tier in enumerate(cache.tiers):
            lock = _take(tier, key, flight.lock_deadline - time.monotonic())
            if lock is False:
                # A holder elsewhere is stuck beyond the timeout: liveness first, compile
                # anyway, unless it published just now.
                cache._stats.count("lock_timeouts")
                entry = _recheck(cache, key, index)
                if entry is not None:
                    return entry
                break
            if lock is None:
                continue
            held.append(lock)
            entry = _recheck(cache, key, index)
            if entry is not None:
                return entry
        flight.extend()
        return compile_and_put(cache, key, fn, flight.publish)
    finally:
        for lock in reversed(held):
            try:
                lock.release()
            except StoreError:
                continue  # counted by the tier; a lease expires, a lock file dies with us


def _take(tier: Store, key: str, timeout: float) -> FlightLock | Literal[False] | None:
    """The tier's lock once held, ``None`` if it has none (or failed), ``False`` on timeout."""
    try:
        lock = tier.flight_lock(key)
        if lock is None:
            return None
        return lock if lock.acquire(max(0.0, timeout)) else False
    except StoreError:
        return None  # counted by the tier; a broken lock must not block the compile


def _recheck(cache: Cache, key: str, locked: int) -> Entry | None:
    """Look again in the tiers a lock holder elsewhere could have filled.

    Tiers above ``locked`` are this process's own (another thread's entry
    would have come through the flight). The first lookup already counted
    this request's miss, so a miss here is not counted a second time.
    """
    for index in range(locked, len(cache.tiers)):
        tier = cache.tiers[index]
        try:
            entry = tier.get(key)
        except StoreError:
            continue
        if entry is not None:
            cache._hit(index, key, entry)
            return entry
        tier._count("misses", -1)
    return None


def compile_and_put(
    cache: Cache, key: str, fn: CompileFn, publish: Callable[[Entry], None] | None = None
) -> Entry:
    """Run ``fn``, record its duration in the entry's meta, ``publish`` it, store it."""
    start = time.perf_counter()
    try:
        result = fn()
    except BaseException:
        cache._stats.count("compile_errors")
        raise
    elapsed = time.perf_counter() - start
    entry = as_entry(result).with_meta(compile_seconds=round(elapsed, 6))
    entry.key = key
    if publish is not None:
        publish(entry)
    cache._stats.compiled(elapsed)
    cache.put(key, entry)
    return entry


def as_entry(result: object) -> Entry:
    """The compile function's result as an Entry (bytes become artifact ``"data"``)."""
    if isinstance(result, Entry):
        return result
    if isinstance(result, (bytes, bytearray, memoryview)):
        return Entry({"data": result})
    raise TypeError(
        f"the compile function must return an Entry or bytes, not {type(result).__name__}"
    )
