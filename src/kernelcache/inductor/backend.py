"""torch's remote-cache backend over kernelcache's tiers, compiled once per team.

torch 2.13 builds each remote cache (``RemoteFxGraphCache``,
``RemoteAOTAutogradCache``, ``RemoteAutotuneCache``,
``RemoteBundledAutotuneCache``) around ``cls.backend_override_cls()`` when that
is set: a bytes store with ``get(key)`` and ``put(key, data)``. The values are
torch's JSON documents, which for the FX graph and AOTAutograd caches hold a
base64 pickle: code. :class:`Backend` stores each one as a kernelcache entry
(artifact ``value``) under a :class:`~kernelcache.keys.KeyBuilder` key of
torch's own key, so it is verified, capped, counted and shared like any
other entry.

Single-flight. torch calls ``get``, compiles on a miss, then ``put``s. A
miss therefore takes the cache's claim (:meth:`kernelcache.Cache.claim`): of
N processes or machines missing the same key, one leads and compiles, the
others wait in ``get`` and return its value. The claim is released by the
``put``; a compile that never puts (torch bypassed its cache, or failed) gives
it up when its ``torch.compile`` call ends (:meth:`Flights.end_compile`),
when a later call finds it older than the timeout, or at exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch._inductor.remote_cache import RemoteCacheBackend

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.keys import KeyBuilder

if TYPE_CHECKING:
    from kernelcache.cache import Cache
    from kernelcache.singleflight import Claim
    from kernelcache.stores.base import Store

logger = logging.getLogger("kernelcache.inductor")

#: Key namespace; bump the version when the entry layout changes.
NAMESPACE = "torch.compile/1"
#: The artifact holding torch's bytes.
VALUE = "value"


def entry_key(torch_key: str, torch_version: str | None = None) -> str:
    """The kernelcache key of a torch remote-cache key (``pt2:fx-graph-v1::...:c1``).

    ``torch_version`` defaults to the installed torch's, build tag included
    (``2.15.0+cu132``). torch hashes its own version and source into its FX
    graph and AOTAutograd keys, not into every autotune key: with it here, two
    releases (or two builds of one) never share an entry, whatever the key's shape.
    """
    version = str(torch.__version__) if torch_version is None else torch_version
    return KeyBuilder(NAMESPACE).add("torch", version).add("torch_key", torch_key).hexdigest()


def cache_id(torch_key: str) -> str:
    """Which of torch's caches a key belongs to (``fx-graph-v1``), for ``kernelcache ls``."""
    head, sep, _ = torch_key.partition("::")
    return head.removeprefix("pt2:") if sep else "unknown"


def is_team_tier(tier: Store) -> bool:
    """A tier that other machines write: neither in this process nor in a local directory."""
    return not tier.in_process and tier.local_dir is None


def unsigned_team_tiers(cache: Cache) -> list[Store]:
    """The team tiers of ``cache`` that load values without checking a signature."""
    return [t for t in cache.tiers if is_team_tier(t) and getattr(t, "secret", None) is None]


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
        """Abandon this thread's claim on ``key``: asked again, its compile never put
        (torch could not pickle it), and waiting on itself would hang until the timeout."""
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
        """Abandon this thread's claims: its ``torch.compile`` call is over."""
        me = threading.get_ident()
        return self.drop(lambda thread, at: thread == me)

    def abandon_all(self) -> int:
        return self.drop(lambda thread, at: True)


class Service:
    """What every :class:`Backend` instance reads and writes through."""

    def __init__(
        self,
        cache: Callable[[], Cache],
        count: Callable[[str], None],
        timeout: Callable[[], float],
    ) -> None:
        self.cache, self.count, self.timeout = cache, count, timeout
        self.flights = Flights()
        atexit.register(self.flights.abandon_all)

    def close(self) -> None:
        atexit.unregister(self.flights.abandon_all)
        self.flights.abandon_all()

    def get(self, torch_key: str) -> bytes | None:
        cache, key, timeout = self.cache(), entry_key(torch_key), self.timeout()
        self.flights.expire(timeout)
        entry = cache.get(key)
        if entry is None:
            self.flights.forget_own(key)
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
            return entry[VALUE]
        except (KeyError, CorruptEntry, StoreError) as exc:  # not one of ours
            logger.warning("kernelcache.inductor: unusable entry %s: %s", entry.key, exc)
            self.count("unusable")
            return None

    def put(self, torch_key: str, data: bytes) -> None:
        cache, key = self.cache(), entry_key(torch_key)
        entry = Entry({VALUE: bytes(data)}, meta={"torch_cache": cache_id(torch_key)})
        claim = self.flights.take(key)
        if claim is not None and claim.leads:
            claim.publish(entry)
        else:
            cache.put(key, entry)
        self.count("puts")


def backend_class(service: Callable[[], Service]) -> type[RemoteCacheBackend[bytes]]:
    """A ``backend_override_cls`` for torch: built with no arguments, as torch calls it."""

    class Backend(RemoteCacheBackend[bytes]):
        """kernelcache as one of torch's remote caches (see :mod:`kernelcache.inductor.backend`)."""

        def _get(self, key: str) -> bytes | None:
            return service().get(key)

        def _put(self, key: str, data: bytes) -> None:
            service().put(key, data)

    return Backend
