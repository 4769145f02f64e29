"""kernelcache: one compilation cache for GPU JIT compilers and CUDA builds.

>>> import kernelcache as kc
>>> cache = kc.Cache()  # memory + disk at KERNELCACHE_DIR (+ Redis if KERNELCACHE_REMOTE)

Integrations (``kernelcache.nvrtc``, ``kernelcache.triton``, ...) are imported
on demand; nothing here imports a compiler.
"""

from typing import TYPE_CHECKING, Any

from kernelcache import fingerprint
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.errors import (
    ConfigError,
    CorruptEntry,
    KernelCacheError,
    ReadOnlyStoreError,
    StoreError,
)
from kernelcache.keys import KeyBuilder, make_key
from kernelcache.settings import Settings
from kernelcache.stores import DiskStore, MemoryStore, Store

if TYPE_CHECKING:
    from kernelcache.stores.sqlite import SQLiteStore

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "ConfigError",
    "CorruptEntry",
    "DiskStore",
    "Entry",
    "KernelCacheError",
    "KeyBuilder",
    "MemoryStore",
    "ReadOnlyStoreError",
    "SQLiteStore",
    "Settings",
    "Store",
    "StoreError",
    "fingerprint",
    "make_key",
]


def __getattr__(name: str) -> Any:
    # SQLiteStore is imported on first use (sqlite3 is slow to import; see stores/__init__).
    if name == "SQLiteStore":
        from kernelcache.stores.sqlite import SQLiteStore

        return SQLiteStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
