"""kernelcache: one compilation cache for GPU JIT compilers and CUDA builds.

>>> import kernelcache as kc
>>> cache = kc.Cache()  # memory + disk at KERNELCACHE_DIR (+ Redis if KERNELCACHE_REMOTE)

Integrations (``kernelcache.nvrtc``, ``kernelcache.triton``, ...) are imported
on demand; nothing here imports a compiler.
"""

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
    "Settings",
    "Store",
    "StoreError",
    "fingerprint",
    "make_key",
]
