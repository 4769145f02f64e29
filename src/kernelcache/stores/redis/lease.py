"""Cross-machine single-flight: a lease in Redis that one compile of a key holds at a time.

``SET lock token NX PX lease`` takes the lease; a daemon thread renews it every
third of its length while the compile runs; only the owner's token can renew
or release it (compare-and-delete in one Lua script, so a holder whose lease
expired can never delete the lease a waiter took over). If the holder dies,
its lease expires and the next waiter takes over: liveness beats deduplication.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from typing import Any, Protocol

from kernelcache.errors import StoreError

# Only the holder of the token may release or renew: a plain DEL after our
# lease expired would delete the lease of the waiter that took over.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Caller(Protocol):
    """What a lease needs from the tier: guarded calls (``guard.Guard`` is one)."""

    def set_nx(self, name: str, value: str, ttl_ms: int) -> bool: ...

    def run_script(self, lua: str, keys: list[str], args: list[Any]) -> Any: ...


class RedisLease:
    """A :class:`~kernelcache.stores.base.FlightLock` held as a renewed lease in Redis.

    ``acquire`` polls every ``poll`` seconds (with jitter) until it holds the
    lease or ``timeout`` passes. When Redis is unreachable (or the tier's
    circuit breaker is open) it returns ``False`` at once: no machine can
    coordinate through it, so the caller compiles without waiting.
    """

    def __init__(self, redis: Caller, name: str, *, lease: float, poll: float = 0.05) -> None:
        if not lease > 0:
            raise ValueError(f"lease must be > 0 seconds, not {lease!r}")
        self._redis = redis
        self.name = name
        self.lease_ms = max(1, int(lease * 1000))
        self.poll = poll
        self.token: str | None = None
        #: Set when a renewal found the lease gone (this process stalled past it).
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"RedisLease({self.name!r}, held={self.token is not None})"

    def acquire(self, timeout: float) -> bool:
        if self.token is not None:
            raise RuntimeError(f"{self!r} is already held")
        token = secrets.token_hex(16)
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._redis.set_nx(self.name, token, self.lease_ms)
            except StoreError:
                return False  # counted by the store; nobody can coordinate through Redis now
            if got:
                self.token = token
                self.lost = False
                self._stop.clear()
                self._renewer = threading.Thread(
                    target=self._renew_loop, name=f"kernelcache-lease-{self.name}", daemon=True
                )
                self._renewer.start()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Jitter spreads the pollers of many machines over the interval.
            time.sleep(min(remaining, self.poll * random.uniform(0.5, 1.5)))

    def release(self) -> None:
        token, self.token = self.token, None
        if token is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        try:
            self._redis.run_script(RELEASE_LUA, [self.name], [token])
        except StoreError:
            return  # counted by the store; the lease expires by itself within lease_ms

    def _renew_loop(self) -> None:
        token = self.token
        interval = self.lease_ms / 3000
        while not self._stop.wait(interval):
            try:
                kept = self._redis.run_script(RENEW_LUA, [self.name], [token, self.lease_ms])
            except StoreError:
                continue  # Redis unreachable: retry; if it stays away the lease lapses
            if not kept:
                self.lost = True
                return
