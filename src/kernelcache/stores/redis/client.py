"""The redis-py clients of the Redis tier: one server or a cluster, on deadline-bound sockets.

Every connection class is made bounded (``wire.py``), so every call of the
client ends by its deadline; retries are redis-py's business only where a
cluster's topology changed. The hit path's GETs run on per-thread connections.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from kernelcache.errors import ConfigError
from kernelcache.stores.redis import wire


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
    try:
        options = parse(url)
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from exc
    base = options.pop("connection_class", Connection)
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "connection_class": wire.bounded(base),
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


def getter(client: Any, *, replicas: bool) -> tuple[Callable[..., Any], Callable[[], None]]:
    """``(get(*args), close)``: GET/GETEX on per-thread connections (wire.ThreadConnections).

    In a cluster the connection is to the node that serves the key; redirects
    (a slot moved) and unreachable nodes go through RedisCluster itself, which
    follows them and refreshes its view of the cluster. With ``replicas``,
    RedisCluster picks the node for every read.
    """
    import redis.exceptions as rx

    connections = wire.ThreadConnections()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return (lambda *args: connections.get(pool, args)), connections.close
    if replicas:
        return client.execute_command, connections.close

    def cluster_get(*args: Any) -> Any:
        try:
            node = client.get_node_from_key(args[1])
        except rx.RedisClusterException:
            node = None
        node_client = getattr(node, "redis_connection", None)
        if node_client is None:
            return client.execute_command(*args)
        try:
            return connections.get(node_client.connection_pool, args)
        except rx.ConnectionError:  # the node went away: RedisCluster retries and learns where
            return client.execute_command(*args)
        except rx.ResponseError as exc:
            message = str(exc)
            if message.startswith("CLUSTERDOWN"):
                raise rx.ClusterDownError(message) from exc
            if not message.startswith(("MOVED ", "ASK ", "TRYAGAIN")):
                raise
            return client.execute_command(*args)  # the slot moved: RedisCluster follows it

    return cluster_get, connections.close


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
