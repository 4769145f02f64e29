"""redis-py clients whose every call ends by one deadline, whatever the server does.

redis-py's ``socket_timeout`` bounds each socket read on its own: a server that
trickles its reply (a few bytes every 100 ms) never trips it, and one get cost
7.3 s while the circuit breaker never opened. Here the connections of a client
wrap their socket so that every connect, send and read of a *call* fits in what
is left of that call's deadline, and so that a reply longer than the call
expects is cut off (a 256 MiB value where a record of at most a few MiB belongs).

:func:`begin` starts a call on this thread (``deadline`` from
``time.monotonic()``, ``limit`` bytes or ``None``); :func:`end` finishes it.
Outside a call the sockets behave exactly like redis-py's own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from kernelcache.errors import ConfigError

#: A socket timeout may overshoot the deadline by this much before it is lowered
#: (each change is a system call; a healthy call needs none).
SLACK = 0.01


class ReplyTooLarge(Exception):
    """The server sent more bytes than the call allows; the connection is dropped.

    Not an ``OSError``, so redis-py neither retries it nor calls the server
    unreachable: it closes the connection and lets it through.
    """


class _Call(threading.local):
    deadline: float | None = None
    limit: int | None = None
    received = 0


_call = _Call()


def begin(deadline: float, limit: int | None) -> None:
    _call.deadline = deadline
    _call.limit = limit
    _call.received = 0


def end() -> None:
    _call.deadline = None
    _call.limit = None


def _remaining() -> float | None:
    deadline = _call.deadline
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the call's deadline passed")  # socket.timeout: redis-py's timeout
    return remaining


class DeadlineSocket:
    """A connected socket whose reads and writes respect the current call's deadline.

    Timeouts set by redis-py itself (``settimeout(0)`` to poll) are kept; the
    socket's timeout is only lowered when the call has less time left than it.
    """

    __slots__ = ("_lowered", "_sock", "_timeout")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self._lowered = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)
        self._timeout = value
        self._lowered = False

    def gettimeout(self) -> float | None:
        return self._timeout

    def _fit(self) -> None:
        remaining = _remaining()
        if remaining is None:
            return
        current = self._timeout
        if current is None or current > remaining + SLACK:
            self._sock.settimeout(remaining)
            self._timeout = remaining
            self._lowered = True
        elif self._lowered and current < remaining - SLACK:
            # Lowered for an earlier call that ended in time: give this one its own.
            self._sock.settimeout(remaining)
            self._timeout = remaining

    def _count(self, n: int) -> None:
        limit = _call.limit
        if limit is not None:
            _call.received += n
            if _call.received > limit:
                raise ReplyTooLarge(f"reply exceeds the {limit} bytes this call allows")

    def recv(self, size: int, flags: int = 0) -> bytes:
        self._fit()
        data = self._sock.recv(size, flags)
        self._count(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._fit()
        n = self._sock.recv_into(buffer, nbytes, flags)
        self._count(n)
        return n

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._fit()
        self._sock.sendall(data, flags)


class _DeadlineConnect:
    """Mixed into a redis-py connection class: connect within the call's deadline."""

    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _connect(self) -> Any:
        remaining = _remaining()
        if remaining is not None:
            self.socket_connect_timeout = min(self.socket_timeout or remaining, remaining)
        return DeadlineSocket(super()._connect())  # type: ignore[misc]


def _classes() -> dict[type, type]:
    import redis.connection as rc

    bases = (rc.Connection, rc.SSLConnection, rc.UnixDomainSocketConnection)
    return {base: type(f"Bounded{base.__name__}", (_DeadlineConnect, base), {}) for base in bases}


_BOUNDED: dict[type, type] = {}


def errors() -> tuple[tuple[type[BaseException], ...], type[BaseException], type[BaseException]]:
    """``(unreachable, timeout, any)`` error classes of redis-py, as the guard sorts them."""
    import redis.exceptions as rx

    # InvalidResponse: whatever listens there does not speak Redis, as good as
    # down. RedisClusterException: no node could be reached to learn the
    # topology; ClusterDownError: the cluster cannot serve the slot.
    unreachable = (
        rx.ConnectionError,
        rx.TimeoutError,
        rx.InvalidResponse,
        rx.RedisClusterException,
        rx.ClusterDownError,
    )
    return unreachable, rx.TimeoutError, rx.RedisError


def factory(url: str, timeout: float, *, cluster: bool, replicas: bool) -> Any:
    """A function making the redis-py client for ``url`` (tried once per call, no retries).

    Making a cluster client talks to the cluster, so the guard makes it on
    first use, inside a call with a deadline, not in the store's constructor.
    """
    try:
        import blake3  # noqa: F401  (checked now, used by signed entries and chunk digests)
        import redis
        import zstandard  # noqa: F401  (checked now, used on the first compressed entry)
        from redis.backoff import NoBackoff
        from redis.connection import Connection, parse_url
        from redis.retry import Retry

        parse: Callable[[str], dict[str, Any]] = parse_url
    except ImportError as exc:
        raise ConfigError(
            f"the Redis tier needs {exc.name}: pip install 'kernelcache[redis]'"
        ) from exc
    if not _BOUNDED:
        _BOUNDED.update(_classes())
    try:
        options = parse(url)
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from exc
    base = options.pop("connection_class", Connection)
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "connection_class": _BOUNDED[base],
        "decode_responses": False,
    }
    if not cluster:
        # redis-py retries 3 times with backoff by default: that multiplies the
        # cost of a dead server; the circuit breaker decides instead.
        retry = Retry(NoBackoff(), 0, ())

        def single() -> Any:
            return redis.Redis(
                connection_pool=redis.ConnectionPool(**options, **common, retry=retry)
            )

        return single
    if options.get("db", 0) != 0:
        raise ConfigError("a Redis Cluster has only database 0: drop the /N from the URL")
    if "path" in options:
        raise ConfigError("a Redis Cluster is reached over TCP, not a unix socket")
    # RedisCluster passes connection_class to the nodes' pools only when given a
    # URL, and a rediss:// URL would replace it with its own: the scheme goes,
    # the bounded TLS class stays.
    plain = urllib.parse.urlsplit(url)._replace(scheme="redis").geturl()
    return _cluster_factory(plain, common, replicas)


def _cluster_factory(url: str, common: dict[str, Any], replicas: bool) -> Any:
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    extra: dict[str, Any] = {}
    if replicas:
        from redis.cluster import LoadBalancingStrategy

        extra["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN

    def cluster() -> Any:
        # One retry after the client refreshed the topology (a failover moved
        # the slot); the call's deadline bounds both tries together.
        return RedisCluster(
            url=url,
            **common,
            **extra,
            retry=Retry(NoBackoff(), 1),
            require_full_coverage=False,
        )

    return cluster


class ThreadConnections:
    """One connection per thread for single commands, skipping the pool (the hit path).

    Taking a connection from redis-py's pool polls it first (two ``settimeout``
    calls and a failing ``recv``) and records metrics: about 10 us of a 37 us
    GET of 4 KiB here. A connection kept per thread needs none of it. A reused
    connection that turns out closed (the server restarted, an idle timeout)
    is reconnected once, within the same deadline. Forked children make their own.
    """

    def __init__(self, pool: Any) -> None:
        import redis.exceptions as rx

        self._pool = pool
        self._closed_errors: tuple[type[Exception], ...] = (rx.ConnectionError,)
        self._timeout_error: type[Exception] = rx.TimeoutError
        self._local = threading.local()
        self._made: list[Any] = []
        self._lock = threading.Lock()

    def execute(self, *args: Any) -> Any:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():
            conn = local.conn = self._pool.connection_class(**self._pool.connection_kwargs)
            local.pid, local.ok = os.getpid(), False
            with self._lock:
                self._made.append(conn)
        reused, local.ok = local.ok, False
        try:
            reply = self._run(conn, args)
        except self._closed_errors as exc:
            conn.disconnect()
            if not reused or isinstance(exc, self._timeout_error):
                raise
            reply = self._run(conn, args)  # the reconnect, once
        local.ok = True
        return reply

    @staticmethod
    def _run(conn: Any, args: tuple[Any, ...]) -> Any:
        conn.send_command(*args)
        return conn.read_response()

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, []
        for conn in made:
            conn.disconnect()


def executor(client: Any) -> tuple[Callable[..., Any], Callable[[], None]]:
    """``(run one command, close)`` for ``client``: per-thread connections for a single
    server; a cluster routes each command itself."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return client.execute_command, lambda: None
    connections = ThreadConnections(pool)
    return connections.execute, connections.close


def nodes(client: Any) -> list[tuple[str | None, Any]]:
    """``(node name, plain client)`` per primary (SCAN works node by node in a cluster).

    A single server is one node without a name.
    """
    get_primaries = getattr(client, "get_primaries", None)
    if get_primaries is None:
        return [(None, client)]
    return [(str(node.name), client.get_redis_connection(node)) for node in get_primaries()]


def node_of(client: Any, key: str) -> str | None:
    """The name of the cluster node serving ``key`` now; ``None`` for a single server."""
    get_node = getattr(client, "get_node_from_key", None)
    if get_node is None:
        return None
    from redis.exceptions import RedisClusterException

    try:
        return str(get_node(key).name)
    except RedisClusterException:
        return None  # the slot has no known owner: the cluster as a whole decides
