"""A tool's own ``get(key) -> bytes`` / ``put(key, bytes)`` cache, through kernelcache's tiers.

torch.compile's remote caches and JAX's persistent compilation cache both
ask one question before compiling (``get``) and, maybe, store the answer
after it (``put``). :class:`Service` is that store over a
:class:`~kernelcache.Cache`: each value becomes an entry (artifact
``value``) under a :class:`~kernelcache.keys.KeyBuilder` key of the tool's
key, verified, capped, counted and shared like any other entry.

Single-flight. A miss takes the cache's claim (:meth:`kernelcache.Cache.claim`):
of N threads, processes or machines missing the same key, one leads and
compiles, the others wait in ``get`` and return its value. The claim is
released by the ``put``. A compile that never puts (the tool bypassed its
cache, the compile was under the tool's threshold, or it failed) gives the
claim up when the integration says its compile call ended
(:meth:`Flights.end_compile`), when a later call finds it older than the
timeout, when the same thread asks for the key again, or at exit.

Both tools' values are code (torch's pickles, JAX's serialized executables):
:func:`trusted` leaves out a team tier that loads entries without checking a
signature, unless the user opted in.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError

if TYPE_CHECKING:
    from kernelcache.cache import Cache
    from kernelcache.singleflight import Claim
    from kernelcache.stores.base import Store

__all__ = ["VALUE", "Flights", "Service", "is_team_tier", "trusted", "unsigned_team_tiers"]

#: The artifact holding the tool's bytes.
VALUE = "value"


def is_team_tier(tier: Store) -> bool:
    """A tier that other machines write (Redis, S3, HTTP). A local SQLite file or a read-only
    disk tier has no ``local_dir`` for statistics, yet only this machine's user writes it."""
    return tier.shared


def unsigned_team_tiers(cache: Cache) -> list[Store]:
    """The team tiers of ``cache`` that load values without checking a signature."""
    return [t for t in cache.tiers if is_team_tier(t) and getattr(t, "secret", None) is None]


def trusted(cache: Cache, trust_unsigned: bool, refused: Callable[[], None]) -> Cache:
    """``cache`` less its unsigned team tiers, unless ``trust_unsigned``.

    ``refused()`` runs when tiers are left out (the integration counts and
    says it once). The local tiers stay: kernelcache's directory trust rule
    already decides whether they may be read.
    """
    from kernelcache.cache import Cache

    unsigned = unsigned_team_tiers(cache)
    if not unsigned or trust_unsigned:
        return cache
    refused()
    kept = [tier for tier in cache.tiers if all(tier is not u for u in unsigned)]
    return Cache(kept, settings=cache.settings)


class Flights:
    """This process's open claims (compiles it leads), by kernelcache key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # key -> (claim, thread that leads it, when it was taken)
        self._open: dict[str, tuple[Claim, int, float]] = {}

    def lead(self, key: str, claim: Claim) -> None:
        with self._lock:
            previous = self._open.pop(key, None)
            self._open[key] = (claim, threading.get_ident(), time.monotonic())
        if previous is not None:  # the same key missed again before its put
            previous[0].abandon()

    def take(self, key: str) -> Claim | None:
        """The open claim on ``key``, removed from the table (its put has come)."""
        with self._lock:
            found = self._open.pop(key, None)
        return None if found is None else found[0]

    def drop(self, stale: Callable[[int, float], bool]) -> int:
        """Abandon the claims for which ``stale(thread, taken_at)``; how many."""
        with self._lock:
            keys = [k for k, (_, thread, at) in self._open.items() if stale(thread, at)]
            dropped = [self._open.pop(k)[0] for k in keys]
        for claim in dropped:
            claim.abandon()
        return len(dropped)

    def forget_own(self, key: str) -> int:
        """Abandon this thread's claim on ``key``: asked again, its compile never put,
        and waiting on itself would hang until the timeout."""
        me = threading.get_ident()
        with self._lock:
            found = self._open.get(key)
            if found is None or found[1] != me:
                return 0
            del self._open[key]
        found[0].abandon()
        return 1

    def expire(self, timeout: float) -> int:
        """Abandon claims older than ``timeout`` seconds (their compile bypassed the cache)."""
        limit = time.monotonic() - timeout
        with self._lock:
            if not self._open:
                return 0
        return self.drop(lambda thread, at: at < limit)

    def end_compile(self) -> int:
        """Abandon this thread's claims: its compile call is over."""
        me = threading.get_ident()
        with self._lock:
            if not self._open:
                return 0
        return self.drop(lambda thread, at: thread == me)

    def abandon_all(self) -> int:
        return self.drop(lambda thread, at: True)


class Service:
    """A tool's get/put byte cache over ``cache()`` (see the module's docstring).

    ``key(tool_key)`` gives the kernelcache key, ``meta(tool_key)`` the
    entry's metadata (its label in ``kernelcache show``), ``usable(value)``
    whether a stored value is one the tool can read (one that is not is a
    miss, counted ``unusable``, and removed). ``count(name)`` counts
    ``hits``, ``misses``, ``waits``, ``puts`` and ``unusable``;
    ``leads()`` says whether this caller may take the claim on a miss
    (``False``: miss at once, another process writes this tool's entries).
    """

    def __init__(
        self,
        cache: Callable[[], Cache],
        count: Callable[[str], None],
        timeout: Callable[[], float],
        *,
        key: Callable[[str], str],
        meta: Callable[[str], Mapping[str, Any]],
        name: str,
        usable: Callable[[bytes], bool] = lambda value: True,
        leads: Callable[[], bool] = lambda: True,
    ) -> None:
        self.cache, self.count, self.timeout = cache, count, timeout
        self.key, self.meta, self.name, self.usable, self.leads = key, meta, name, usable, leads
        self.logger = logging.getLogger(f"kernelcache.{name}")
        self.flights = Flights()
        atexit.register(self.flights.abandon_all)

    def close(self) -> None:
        atexit.unregister(self.flights.abandon_all)
        self.flights.abandon_all()

    def get(self, tool_key: str) -> bytes | None:
        cache, key, timeout = self.cache(), self.key(tool_key), self.timeout()
        self.flights.expire(timeout)
        entry = cache.get(key)
        if entry is None:
            self.flights.forget_own(key)
            if not self.leads():
                self.count("misses")
                return None
            claim = cache.claim(key, timeout=timeout)
            if claim.entry is None:
                self.flights.lead(key, claim)
                self.count("misses")
                return None
            self.count("waits")
            entry = claim.entry
        value = self._value(entry)
        if value is None:
            cache.delete(key)
            self.count("misses")
        else:
            self.count("hits")
        return value

    def _value(self, entry: Entry) -> bytes | None:
        try:
            value = entry[VALUE]
        except (KeyError, CorruptEntry, StoreError) as exc:  # not one of ours
            self.logger.warning("kernelcache.%s: unusable entry %s: %s", self.name, entry.key, exc)
            self.count("unusable")
            return None
        if not self.usable(value):
            self.logger.warning(
                "kernelcache.%s: unusable entry %s: not a value %s can read",
                self.name,
                entry.key,
                self.name,
            )
            self.count("unusable")
            return None
        return value

    def put(self, tool_key: str, data: bytes) -> None:
        cache, key = self.cache(), self.key(tool_key)
        entry = Entry({VALUE: bytes(data)}, meta=self.meta(tool_key))
        claim = self.flights.take(key)
        if claim is not None and claim.leads:
            claim.publish(entry)
        else:
            cache.put(key, entry)
        self.count("puts")
