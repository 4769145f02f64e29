"""The local-directory tier: :class:`DiskStore` (``store.py``), where its files live and
which directories it trusts (``layout.py``), its counter, removals and eviction
(``space.py``, with the LRU order in ``lru.py``), the files it extracts for
``Entry.path()`` (``files.py``) and the packs small entries live in (``pack.py``, their index ``packindex.py``)."""

from __future__ import annotations

from kernelcache.stores.disk.layout import SHARDS, SUFFIX, UnsafeDirectory, shard_of
from kernelcache.stores.disk.space import LOW_WATER
from kernelcache.stores.disk.store import (
    STALE_STAGING_SECONDS,
    TOUCH_INTERVAL,
    DiskCounters,
    DiskStore,
)

__all__ = [
    "LOW_WATER",
    "SHARDS",
    "STALE_STAGING_SECONDS",
    "SUFFIX",
    "TOUCH_INTERVAL",
    "DiskCounters",
    "DiskStore",
    "UnsafeDirectory",
    "shard_of",
]
