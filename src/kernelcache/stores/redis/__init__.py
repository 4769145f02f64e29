"""The team tier: :class:`RedisStore` (``store.py``), its record format (``format.py``),
URL options (``config.py``), single-flight lease (``lease.py``) and circuit breaker
(``breaker.py``)."""

from __future__ import annotations

from kernelcache.stores.redis.store import (
    GRACE_SECONDS,
    MAX_CHUNKS,
    STAGING_SECONDS,
    RedisStore,
)

__all__ = ["GRACE_SECONDS", "MAX_CHUNKS", "STAGING_SECONDS", "RedisStore"]
