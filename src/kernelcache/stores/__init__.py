"""Storage tiers. Each module holds one tier; all share :class:`~kernelcache.stores.base.Store`."""

from __future__ import annotations

from kernelcache.stores.base import Counters, EntryInfo, Store, validate_key
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from kernelcache.stores.redis import RedisStore
    from kernelcache.stores.sqlite import SQLiteStore

__all__ = [
    "Counters",
    "DiskStore",
    "EntryInfo",
    "MemoryStore",
    "RedisStore",
    "SQLiteStore",
    "Store",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: sqlite3 costs ~10 ms at start-up and redis-py more,
    # which the `kernelcache nvcc` hit path should not pay when it never opens them.
    if name == "SQLiteStore":
        from kernelcache.stores.sqlite import SQLiteStore

        return SQLiteStore
    if name == "RedisStore":
        from kernelcache.stores.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
