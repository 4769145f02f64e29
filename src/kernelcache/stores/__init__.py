"""Storage tiers. Each module holds one tier; all share :class:`~kernelcache.stores.base.Store`."""

from kernelcache.stores.base import Counters, EntryInfo, Store, validate_key
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

__all__ = ["Counters", "DiskStore", "EntryInfo", "MemoryStore", "Store", "validate_key"]


def __getattr__(name: str) -> object:
    # RedisStore on demand: importing kernelcache must not cost the Redis tier's imports.
    if name == "RedisStore":
        from kernelcache.stores.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
