"""Storage tiers. Each module holds one tier; all share :class:`~kernelcache.stores.base.Store`."""

from kernelcache.stores.base import Counters, EntryInfo, Store, validate_key
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

__all__ = ["Counters", "DiskStore", "EntryInfo", "MemoryStore", "Store", "validate_key"]
