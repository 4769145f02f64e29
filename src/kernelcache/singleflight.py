"""Single-flight compiles: of many callers asking for one missing key, one compiles.

Three levels, each one admitting the next:

1. threads of one process: the first caller of a key leads, the others wait
   on its :class:`Flight` (an event) and take the entry it publishes;
2. processes and machines: the leader takes each tier's
   :meth:`~kernelcache.stores.base.Store.flight_lock` in tier order (the disk
   tier's lock file, then a remote tier's lease), looking in the tiers again
   after each lock, since whoever held it may have published the entry meanwhile.

The outcome is a :class:`Claim`: either the entry someone else published
while we waited, or the right to compile, held until :meth:`Claim.publish`
or :meth:`Claim.abandon`. ``Cache.get_or_compile`` is one claim around one
function call; an integration whose compile spans several calls (Triton's
``get_group`` ... ``put_group``) holds a claim across them.

Liveness beats deduplication: a waiter whose wait runs past ``timeout``
compiles itself. A compile that fails abandons its claim; the waiters then
start over and one of them compiles. Failures are never cached. (PyTorch
#108971: eight ranks compiling the same kernel.)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Literal, Protocol, TypeVar

from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.stores.base import FlightLock, Store

CompileFn = Callable[[], "Entry | bytes"]
T = TypeVar("T")

# Event.wait and the lock waits reject timeouts above this (OverflowError);
# timeout=float("inf") means "wait as long as it takes".
_LONGEST_WAIT = threading.TIMEOUT_MAX


class Events(Protocol):
    """Where single-flight reports what happened (the Cache's statistics)."""

    #: The directory whose totals these events merge into (``None``: this process only).
    directory: str | None

    def count(self, name: str, amount: float = 1) -> None: ...

    def compiled(self, seconds: float) -> None: ...


def _same_totals(a: Events, b: Events) -> bool:
    """Whether two Caches' events add up in the same statistics."""
    return a is b or (a.directory is not None and a.directory == b.directory)


class _Lead:
    """An open claim as its thread's list holds it: the statistics it counts into, and
    the seconds and keys of the compiles published inside it (counted there already)."""

    __slots__ = ("events", "inner", "nested")

    def __init__(self, events: Events) -> None:
        self.events = events
        self.inner = 0.0
        self.nested: list[str] = []


# The claims each thread leads, outermost first. A compile can run inside another's
# claim: torch's AOTAutograd compile holds its FX graph's, which holds its C++ builds'.
_leading = threading.local()
# Guards each _Lead's inner and nested: claims carried to other threads (carried())
# publish into the same outer claim at once.
_nesting = threading.Lock()


def _leading_here() -> list[_Lead]:
    leads: list[_Lead] | None = getattr(_leading, "leads", None)
    if leads is None:
        leads = _leading.leads = []
    return leads


def carried(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` as part of the claims this thread leads now, wherever it runs.

    For work a compile hands to a thread pool and waits for: torch builds an
    FX graph's C++ kernels on its compile threads. Claims that ``fn`` publishes
    on another thread then count inside this thread's open claims, as they
    would have on this thread: their seconds once, their keys in the enclosing
    entry's ``nested``. Returns ``fn`` itself when this thread leads no claim.
    """
    leads = list(_leading_here())
    if not leads:
        return fn
    home = threading.get_ident()

    def run() -> T:
        if threading.get_ident() == home:  # run inline (a pool of one thread)
            return fn()
        before = getattr(_leading, "leads", None)
        _leading.leads = list(leads)
        try:
            return fn()
        finally:
            _leading.leads = before if before is not None else []

    return run


class Flight:
    """One in-process compile of a key that other threads can wait for."""

    __slots__ = ("deadline", "done", "entry", "leader", "lock_deadline", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.leader = threading.get_ident()
        now = time.monotonic()
        #: When the leader stops waiting for other processes' locks and compiles itself.
        self.lock_deadline = now + timeout
        # Waiters allow the leader its lock wait plus a full timeout for the compile:
        # giving up at the same moment as the leader would compile twice in one process.
        self.deadline = now + 2 * timeout
        self.done = threading.Event()
        self.entry: Entry | None = None  # None when done: the leader failed

    def extend(self) -> None:
        """The leader started compiling: give waiters a full timeout for the compile itself."""
        self.deadline = time.monotonic() + self.timeout

    def wait(self) -> bool:
        """Wait until the leader finishes (``True``) or the deadline passes (``False``)."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return self.done.is_set()
            if self.done.wait(min(remaining, _LONGEST_WAIT)):
                return True
            # The deadline may have been extended while we slept: look again.


class Flights:
    """The in-process table of keys being compiled."""

    def __init__(self) -> None:
        self.reset()
        _tables.add(self)

    def reset(self) -> None:
        """Forget every flight (a forked child has none of the parent's leader threads)."""
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}

    def join(self, key: str, timeout: float) -> tuple[Flight, bool]:
        """The flight for ``key`` and whether the caller leads it (it had none)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = Flight(timeout)
                return flight, True
        if flight.leader == threading.get_ident():
            # Waiting would mean waiting for ourselves until the timeout runs out.
            raise RuntimeError(
                f"key {key!r} is requested again from inside its own compile "
                "(the compile function asks for the key it is compiling)"
            )
        return flight, False

    def land(self, key: str, flight: Flight, entry: Entry | None) -> None:
        """End the leader's flight, handing its waiters ``entry`` (``None``: it failed)."""
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        if not flight.done.is_set():
            flight.entry = entry
            flight.done.set()


_tables: weakref.WeakSet[Flights] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for table in list(_tables):
        table.reset()
    _leading.leads = []  # the parent's claims are not the child's to publish


os.register_at_fork(after_in_child=_after_fork_in_child)


class SingleFlight:
    """Claims on keys over a sequence of tiers.

    Collaborators, all given by the owner (a :class:`~kernelcache.Cache`):
    ``tiers`` (for their flight locks), ``lookup(start, key)`` (look in
    ``tiers[start:]``, promote and count a hit, do not count a miss again),
    ``store(key, entry)`` (write to every tier; returns the entry as stored)
    and ``events`` (statistics).
    """

    def __init__(
        self,
        tiers: Sequence[Store],
        lookup: Callable[[int, str], Entry | None],
        store: Callable[[str, Entry], Entry],
        events: Events,
    ) -> None:
        self.tiers = tiers
        self.lookup = lookup
        self.store = store
        self.events = events
        self.flights = Flights()

    def claim(self, key: str, timeout: float) -> Claim:
        """Wait for another compile of ``key`` or take the right to compile it."""
        while True:
            flight, leader = self.flights.join(key, timeout)
            if leader:
                return self._lead(key, flight)
            if not flight.wait():
                self.events.count("lock_timeouts")
                return Claim(self, key, contended=True)  # the leader is stuck: liveness first
            if flight.entry is not None:
                self.events.count("flight_waits")
                return Claim(self, key, entry=flight.entry)
            # The leader's compile failed: start over; one of the waiters leads next.
            entry = self.lookup(0, key)
            if entry is not None:
                return Claim(self, key, entry=entry)

    def _lead(self, key: str, flight: Flight) -> Claim:
        held: list[FlightLock] = []
        contended = False
        try:
            for index, tier in enumerate(self.tiers):
                wait = min(max(0.0, flight.lock_deadline - time.monotonic()), _LONGEST_WAIT)
                lock = _take(tier, key, wait)
                if lock is None:
                    continue
                if lock is not False:
                    held.append(lock)
                entry = self.lookup(index, key)
                if entry is not None:
                    # Landed before the locks go: whatever a release does, the
                    # key never stays in the table (it would poison it for good).
                    self.flights.land(key, flight, entry)
                    _release(held)
                    return Claim(self, key, entry=entry)
                if lock is False:
                    # A holder elsewhere is stuck beyond the timeout: liveness first.
                    self.events.count("lock_timeouts")
                    contended = True
                    break
        except BaseException:
            self.flights.land(key, flight, None)
            _release(held)
            raise
        flight.extend()
        return Claim(self, key, flight=flight, locks=held, contended=contended)


class Claim:
    """The outcome of :meth:`SingleFlight.claim` (``Cache.claim``).

    If :attr:`entry` is set, another compile published it: use it, there is
    nothing to do. Otherwise this caller must compile, then :meth:`publish`
    the result (or :meth:`abandon`, e.g. when the compile failed) so that
    the others stop waiting. Leaving a ``with`` block without publishing
    abandons. Not thread-safe: one caller owns a claim.
    """

    def __init__(
        self,
        owner: SingleFlight,
        key: str,
        *,
        entry: Entry | None = None,
        flight: Flight | None = None,
        locks: Sequence[FlightLock] = (),
        contended: bool = False,
    ) -> None:
        self.key = key
        self.entry = entry
        #: Whether it leads although another process or machine still held a lock
        #: when its wait ran out (``timeout=0``: a try that found the key busy).
        self.contended = contended
        self._owner = owner
        self._flight = flight
        self._locks = list(locks)
        self._started = time.perf_counter()
        self._open = entry is None
        self._thread = threading.get_ident()
        self._lead = _Lead(owner.events)
        # The leading thread's list: whichever thread closes the claim takes it out.
        self._leads: list[_Lead] = _leading_here() if self._open else []
        if self._open:
            self._leads.append(self._lead)

    def __repr__(self) -> str:
        state = "found" if self.entry is not None else "open" if self._open else "closed"
        return f"Claim({self.key!r}, {state})"

    @property
    def leads(self) -> bool:
        """Whether this caller is the one that must compile (and has not finished)."""
        return self._open

    def compile(self, fn: CompileFn) -> Entry:
        """Run ``fn`` and publish its result, timing the call alone; abandon if it raises."""
        start = time.perf_counter()
        try:
            result = fn()
        except BaseException:
            self.fail()
            raise
        return self.publish(result, seconds=time.perf_counter() - start)

    def publish(self, result: Entry | bytes, seconds: float | None = None) -> Entry:
        """Store the compiled entry, wake the waiters, release the locks.

        ``seconds`` is the compile's duration (default: since the claim was
        taken), recorded in the entry's meta as ``compile_seconds``. Returns
        the entry as stored.
        """
        if not self._open:
            raise RuntimeError(f"{self!r} has nothing to publish")
        try:
            elapsed = time.perf_counter() - self._started if seconds is None else seconds
            # The entry keeps the whole time (a hit saves all of it); the statistics count
            # each second once. It names the entries published inside its compile: a hit
            # on it saved their time too, which their own hits must not count again
            # (torch loads an AOTAutograd hit's FX graphs as hits of their own).
            meta: dict[str, object] = {"compile_seconds": round(elapsed, 6)}
            with _nesting:
                nested = list(self._lead.nested)
            if nested:
                meta["nested"] = nested
            entry = as_entry(result).with_meta(**meta)
            self._owner.events.compiled(self._own_seconds(elapsed))
            # Waiters get the entry as stored (its path() files inside the disk
            # tier), after the write: a few hundred microseconds next to a compile.
            entry = self._owner.store(self.key, entry)
            self.entry = entry
        finally:
            self._close(self.entry)
        return entry

    def fail(self) -> None:
        """The compile raised: counted (``compile_errors``), and the claim abandoned."""
        if self._open:
            self._owner.events.count("compile_errors")
        self.abandon()

    def hand_over(self) -> Claim:
        """Let another thread publish or abandon this claim, after the compile (returns it).

        The claim stops counting as open in this thread: a claim this thread
        opens next (the caller's next compile) is not taken as nested in it.
        """
        self._leave()
        return self

    def abandon(self) -> None:
        """Give the claim up without an entry: the waiters start over. Idempotent."""
        if self._open:
            self._close(None)

    def _own_seconds(self, elapsed: float) -> float:
        """``elapsed`` less the compiles published inside this claim; the claim this
        one runs inside (the nearest of this thread's counting into the same
        statistics) is told, so that it leaves these seconds out in turn and names
        this key in its entry."""
        lead, leads = self._lead, self._leads
        with _nesting:
            if threading.get_ident() == self._thread and lead in leads:  # nested in its thread
                for outer in reversed(leads[: leads.index(lead)]):
                    if _same_totals(outer.events, lead.events):
                        outer.inner += elapsed
                        outer.nested.append(self.key)
                        break
            return max(0.0, elapsed - lead.inner)

    def _close(self, entry: Entry | None) -> None:
        self._open = False
        self._leave()
        if self._flight is not None:
            self._owner.flights.land(self.key, self._flight, entry)
            self._flight = None
        locks, self._locks = self._locks, []
        _release(locks)

    def _leave(self) -> None:
        # list.remove is one atomic step, so another thread may close the claim.
        with contextlib.suppress(ValueError):
            self._leads.remove(self._lead)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abandon()


def _take(tier: Store, key: str, timeout: float) -> FlightLock | Literal[False] | None:
    """The tier's lock once held, ``None`` if it has none (or failed), ``False`` on timeout."""
    try:
        lock = tier.flight_lock(key)
        if lock is None:
            return None
        return lock if lock.acquire(timeout) else False
    except StoreError:
        return None  # counted by the tier; a broken lock must not block the compile


def _release(locks: list[FlightLock]) -> None:
    for lock in reversed(locks):
        try:
            lock.release()
        except (StoreError, OSError):
            continue  # counted by the tier; a lease expires, a lock file dies with us
    locks.clear()


def as_entry(result: object) -> Entry:
    """The compile function's result as an Entry (bytes become artifact ``"data"``)."""
    if isinstance(result, Entry):
        return result
    if isinstance(result, (bytes, bytearray, memoryview)):
        return Entry({"data": result})
    raise TypeError(
        f"the compile function must return an Entry or bytes, not {type(result).__name__}"
    )
