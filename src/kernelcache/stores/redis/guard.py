"""The guarded call: the one way the Redis tier and its lease talk to Redis.

Every call goes through a circuit breaker, ends by one deadline (connect,
send and every read included; see ``client.py``), may cap the bytes of its
reply, and turns every redis-py error into a counted
:class:`~kernelcache.errors.StoreError`. The store and the lease share one
:class:`Guard`, so a lease poll against a dead server opens the same breaker
that lookups then skip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kernelcache.errors import StoreError
from kernelcache.stores.base import Counters
from kernelcache.stores.redis import client as rc
from kernelcache.stores.redis.breaker import CircuitBreaker

T = TypeVar("T")

#: A call moving N bytes may take N / TRANSFER_FLOOR seconds more than the timeout:
#: the timeout bounds a round trip, not the transfer of a large entry's chunks.
TRANSFER_FLOOR = 16 << 20


class OversizedReply(StoreError):
    """The reply was longer than the call allows; it was not read to its end."""


class Guard:
    """Guarded calls to one Redis server or cluster (thread-safe).

    ``make_client`` builds the redis-py client; it runs on the first call,
    inside that call's deadline, because a cluster client talks to the
    cluster as it is made. Failures count in ``counters`` (``errors``,
    ``timeouts``, ``skipped``, ``breaker_trips``).
    """

    def __init__(
        self,
        make_client: Callable[[], Any],
        *,
        timeout: float,
        breaker: CircuitBreaker,
        counters: Counters,
        label: str,
    ) -> None:
        self.timeout = timeout
        self.breaker = breaker
        self.counters = counters
        self.label = label
        self._make_client = make_client
        self._client: Any = None
        self._lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._unreachable, self._timeout_error, self._any_error = rc.errors()

    def __repr__(self) -> str:
        return self.label

    def call(self, fn: Callable[[Any], T], *, limit: int | None = None, moving: int = 0) -> T:
        """``fn(client)`` within one deadline; a reply over ``limit`` bytes is refused.

        ``moving``: bytes the call sends or receives on purpose (chunks), which
        extend the deadline at :data:`TRANSFER_FLOOR` bytes per second.
        """
        if not self.breaker.allow():
            self.counters.add("skipped")
            raise StoreError(f"{self.label}: skipped, circuit open after repeated failures")
        deadline = time.monotonic() + self.timeout + moving / TRANSFER_FLOOR
        rc.begin(deadline, limit)
        try:
            client = self._client if self._client is not None else self._connect()
            result = fn(client)
        except rc.ReplyTooLarge as exc:  # the server answered: it is not down
            self.breaker.record_success()
            raise OversizedReply(f"{self.label}: {exc}") from exc
        except self._unreachable as exc:
            self._failed(exc, timed_out=time.monotonic() >= deadline)
            raise StoreError(f"{self.label}: {type(exc).__name__}: {exc}") from exc
        except self._any_error as exc:  # an error reply: the server is up
            self.counters.add("errors")
            self.breaker.record_success()
            raise StoreError(f"{self.label}: {type(exc).__name__}: {exc}") from exc
        finally:
            rc.end()
        self.breaker.record_success()
        return result

    def _connect(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _failed(self, exc: BaseException, timed_out: bool) -> None:
        self.counters.add("errors")
        if timed_out or isinstance(exc, self._timeout_error):
            self.counters.add("timeouts")
        if self.breaker.record_failure():
            self.counters.add("breaker_trips")

    # Conveniences shared by the store and the lease --------------------------------
    def command(self, *args: Any, limit: int | None = None) -> Any:
        return self.call(lambda client: client.execute_command(*args), limit=limit)

    def run_script(self, lua: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a Lua script (EVALSHA, loading it where the server lacks it)."""
        return self.call(lambda client: self._script(client, lua)(list(keys), list(args)))

    def _script(self, client: Any, lua: str) -> Any:
        script = self._scripts.get(lua)
        if script is None:
            script = self._scripts[lua] = client.register_script(lua)
        return script

    def set_nx(self, name: str, value: str, ttl_ms: int) -> bool:
        """``SET name value NX PX ttl_ms``: whether the key was free and is now ours."""
        return self.command("SET", name, value, "NX", "PX", ttl_ms) is not None

    def pipeline(
        self,
        build: Callable[[Any], None],
        *,
        limit: int | None = None,
        moving: int = 0,
        raise_on_error: bool = True,
        client: Any = None,
    ) -> list[Any]:
        """Queue commands with ``build(pipe)`` and run them as one call (no transaction).

        ``client``: a node's client from :meth:`nodes` instead of the main one.
        """

        def run(main: Any) -> list[Any]:
            pipe = (client or main).pipeline(transaction=False)
            build(pipe)
            return list(pipe.execute(raise_on_error))

        return self.call(run, limit=limit, moving=moving)

    def nodes(self) -> list[Any]:
        """A plain client per primary node (one for a single server)."""
        return self.call(rc.nodes)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
