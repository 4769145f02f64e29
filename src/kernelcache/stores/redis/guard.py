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
from kernelcache.stores.redis import wire
from kernelcache.stores.redis.breaker import CircuitBreaker

T = TypeVar("T")

TRANSFER_FLOOR = wire.TRANSFER_FLOOR


class OversizedReply(StoreError):
    """The reply was longer than the call allows; it was not read to its end."""


class Guard:
    """Guarded calls to one Redis server or cluster (thread-safe).

    ``make_client`` builds the redis-py client; it runs on the first call,
    inside that call's deadline, because a cluster client talks to the
    cluster as it is made. Failures count in ``counters`` (``errors``,
    ``timeouts``, ``skipped``, ``breaker_trips``).

    In a cluster each node has its own circuit breaker (``make_breaker``
    makes them): a call about a key goes through the breaker of the node
    serving it, so one dead node does not switch off the healthy ones.
    ``breaker`` guards what concerns no one node (reaching the cluster at all).
    """

    def __init__(
        self,
        make_client: Callable[[], Any],
        *,
        timeout: float,
        breaker: CircuitBreaker,
        counters: Counters,
        label: str,
        make_breaker: Callable[[], CircuitBreaker] | None = None,
        replicas: bool = False,
    ) -> None:
        self.timeout = timeout
        self.breaker = breaker
        #: Breakers of cluster nodes, by node name ("host:port").
        self.node_breakers: dict[str, CircuitBreaker] = {}
        self._make_breaker = make_breaker
        self.counters = counters
        self.label = label
        self._make_client = make_client
        self._client: Any = None
        self._replicas = replicas
        self._get: Callable[..., Any] = _not_connected
        self._close_get: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._unreachable, self._timeout_error, self._any_error = rc.errors()

    def __repr__(self) -> str:
        return self.label

    def call(
        self,
        fn: Callable[[Any], T],
        *,
        key: str | None = None,
        node: str | None = None,
        limit: int | None = None,
        moving: int = 0,
    ) -> T:
        """``fn(client)`` within one deadline; a reply over ``limit`` bytes is refused.

        ``key`` (a Redis key name the call is about) or ``node`` (a node name)
        picks the cluster node's breaker. ``moving``: bytes the call sends or
        receives on purpose (chunks), which extend the deadline at
        :data:`TRANSFER_FLOOR` bytes per second.
        """
        breaker = self._breaker(key, node)
        if not breaker.allow():
            self.counters.add("skipped")
            raise StoreError(f"{self.label}: skipped, circuit open after repeated failures")
        deadline = time.monotonic() + self.timeout + moving / TRANSFER_FLOOR
        wire.begin(deadline, limit)
        try:
            client = self._client if self._client is not None else self._connect()
            result = fn(client)
        except wire.ReplyTooLarge as exc:  # the server answered: it is not down
            breaker.record_success()
            raise OversizedReply(f"{self.label}: {exc}") from exc
        except self._unreachable as exc:
            self._failed(breaker, exc, timed_out=time.monotonic() >= deadline)
            raise StoreError(f"{self.label}: {type(exc).__name__}: {exc}") from exc
        except self._any_error as exc:  # an error reply: the server is up
            self.counters.add("errors")
            breaker.record_success()
            raise StoreError(f"{self.label}: {type(exc).__name__}: {exc}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            # redis-py refusing how it was configured (a keyword it does not take:
            # issue 20's `?namspace=`): a failing tier, counted like one, never an
            # exception from Cache.get. Settings refuse such URLs up front now.
            self._failed(breaker, exc, timed_out=False)
            raise StoreError(
                f"{self.label}: client misconfigured: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            wire.end()
        breaker.record_success()
        return result

    def _breaker(self, key: str | None, node: str | None) -> CircuitBreaker:
        if self._make_breaker is None or self._client is None:
            return self.breaker
        if node is None and key is not None:
            node = rc.node_of(self._client, key)
        if node is None:
            return self.breaker
        breaker = self.node_breakers.get(node)
        if breaker is None:
            with self._lock:
                breaker = self.node_breakers.setdefault(node, self._make_breaker())
        return breaker

    def _connect(self) -> Any:
        with self._lock:
            if self._client is None:
                client = self._make_client()
                self._get, self._close_get = rc.getter(client, replicas=self._replicas)
                self._client = client
            return self._client

    def _failed(self, breaker: CircuitBreaker, exc: BaseException, timed_out: bool) -> None:
        self.counters.add("errors")
        if timed_out or isinstance(exc, self._timeout_error):
            self.counters.add("timeouts")
        if breaker.record_failure():
            self.counters.add("breaker_trips")

    # Conveniences shared by the store and the lease --------------------------------
    def get(self, *args: Any, limit: int | None = None) -> Any:
        """GET or GETEX (``args``) of key ``args[1]``: the hit path (``wire.ThreadConnections``)."""
        return self.call(lambda _client: self._get(*args), key=args[1], limit=limit)

    def command(self, *args: Any, limit: int | None = None) -> Any:
        """``args[0]`` on key ``args[1]``."""
        return self.call(lambda client: client.execute_command(*args), key=args[1], limit=limit)

    def run_script(
        self, lua: str, keys: Sequence[str], args: Sequence[Any], *, moving: int = 0
    ) -> Any:
        """Run a Lua script (EVALSHA, loading it where the server lacks it)."""
        return self.call(
            lambda client: self._script(client, lua)(list(keys), list(args)),
            key=keys[0],
            moving=moving,
        )

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
        key: str | None = None,
        node: tuple[str | None, Any] | None = None,
    ) -> list[Any]:
        """Queue commands with ``build(pipe)`` and run them as one call (no transaction).

        ``key``: a key the commands are about (they share its slot); ``node``:
        a ``(name, client)`` from :meth:`nodes`, to run on that node alone.
        """

        def run(main: Any) -> list[Any]:
            pipe = (node[1] if node else main).pipeline(transaction=False)
            build(pipe)
            return list(pipe.execute(raise_on_error))

        name = node[0] if node else None
        return self.call(run, key=key, node=name, limit=limit, moving=moving)

    def nodes(self) -> list[tuple[str | None, Any]]:
        """``(name, plain client)`` per primary node (one, unnamed, for a single server)."""
        return self.call(rc.nodes)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            self._close_get()
            client.close()


def _not_connected(*args: Any) -> Any:
    raise RuntimeError("a guarded call runs its command after the client is made")
