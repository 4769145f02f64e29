"""The team tier: :class:`RedisStore` (``store.py``) over one Redis server or a Redis Cluster.

``layout.py`` names the keys, ``format.py`` is the record format (signing,
compression, limits), ``chunks.py`` writes and reads large entries,
``guard.py`` is the guarded call every command goes through (breaker,
deadline, reply cap) over the bounded connections of ``client.py``;
``config.py`` reads URL options, ``lease.py`` is the single-flight lease,
``breaker.py`` the circuit breaker.
"""

from __future__ import annotations

from kernelcache.stores.redis.badvalues import BAD_SECONDS
from kernelcache.stores.redis.store import (
    GRACE_SECONDS,
    MAX_CHUNKS,
    STAGING_SECONDS,
    RedisCounters,
    RedisStore,
)

__all__ = [
    "BAD_SECONDS",
    "GRACE_SECONDS",
    "MAX_CHUNKS",
    "STAGING_SECONDS",
    "RedisCounters",
    "RedisStore",
]
