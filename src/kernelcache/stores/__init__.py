"""Storage tiers. Each module holds one tier; all share :class:`~kernelcache.stores.base.Store`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernelcache.stores.base import Counters, EntryInfo, Store, validate_key
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

if TYPE_CHECKING:
    from kernelcache.stores.http import HTTPStore
    from kernelcache.stores.redis import RedisStore
    from kernelcache.stores.s3 import S3Store
    from kernelcache.stores.sqlite import SQLiteStore

__all__ = [
    "Counters",
    "DiskStore",
    "EntryInfo",
    "HTTPStore",
    "MemoryStore",
    "RedisStore",
    "S3Store",
    "SQLiteStore",
    "Store",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: sqlite3 costs ~10 ms to import and redis-py more,
    # which programs that use neither tier should not pay.
    if name == "SQLiteStore":
        from kernelcache.stores.sqlite import SQLiteStore

        return SQLiteStore
    if name == "RedisStore":
        from kernelcache.stores.redis import RedisStore

        return RedisStore
    if name == "S3Store":
        from kernelcache.stores.s3 import S3Store

        return S3Store
    if name == "HTTPStore":
        from kernelcache.stores.http import HTTPStore

        return HTTPStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
