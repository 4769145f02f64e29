"""kernelcache: one compilation cache for GPU JIT compilers and CUDA builds.

>>> import kernelcache as kc
>>> cache = kc.Cache()  # memory + disk at KERNELCACHE_DIR (+ Redis if KERNELCACHE_REMOTE)

Every public name is imported on first use (PEP 562), from the one table
below: ``import kernelcache`` costs nothing it does not need, and an
integration whose compiler is not installed says which extra to install.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# Not typing.TYPE_CHECKING: `import kernelcache` should not cost every program
# typing's ~3 ms; type checkers know the idiom. Deleted below: not a public name.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from kernelcache import (
        autotune,
        cuda_core,
        fingerprint,
        memoize,
        ninetoothed,
        nvrtc,
        stores,
        tilelang,
        toolchain,
        triton,
    )
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
    from kernelcache.singleflight import Claim
    from kernelcache.stores import DiskStore, MemoryStore, Store
    from kernelcache.stores.redis import RedisStore
    from kernelcache.stores.sqlite import SQLiteStore

#: public name -> (module, attribute); attribute None: the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "Cache": ("kernelcache.cache", "Cache"),
    "Claim": ("kernelcache.singleflight", "Claim"),
    "ConfigError": ("kernelcache.errors", "ConfigError"),
    "CorruptEntry": ("kernelcache.errors", "CorruptEntry"),
    "DiskStore": ("kernelcache.stores.disk", "DiskStore"),
    "Entry": ("kernelcache.entry", "Entry"),
    "KernelCacheError": ("kernelcache.errors", "KernelCacheError"),
    "KeyBuilder": ("kernelcache.keys", "KeyBuilder"),
    "MemoryStore": ("kernelcache.stores.memory", "MemoryStore"),
    "ReadOnlyStoreError": ("kernelcache.errors", "ReadOnlyStoreError"),
    "RedisStore": ("kernelcache.stores.redis", "RedisStore"),
    "SQLiteStore": ("kernelcache.stores.sqlite", "SQLiteStore"),
    "Settings": ("kernelcache.settings", "Settings"),
    "Store": ("kernelcache.stores.base", "Store"),
    "StoreError": ("kernelcache.errors", "StoreError"),
    "make_key": ("kernelcache.keys", "make_key"),
    "autotune": ("kernelcache.autotune", None),
    "cuda_core": ("kernelcache.cuda_core", None),
    "fingerprint": ("kernelcache.fingerprint", None),
    "memoize": ("kernelcache.memoize", None),
    "ninetoothed": ("kernelcache.ninetoothed", None),
    "nvrtc": ("kernelcache.nvrtc", None),
    "stores": ("kernelcache.stores", None),
    "tilelang": ("kernelcache.tilelang", None),
    "toolchain": ("kernelcache.toolchain", None),
    "triton": ("kernelcache.triton", None),
}

__all__ = [
    "Cache",
    "Claim",
    "ConfigError",
    "CorruptEntry",
    "DiskStore",
    "Entry",
    "KernelCacheError",
    "KeyBuilder",
    "MemoryStore",
    "ReadOnlyStoreError",
    "RedisStore",
    "SQLiteStore",
    "Settings",
    "Store",
    "StoreError",
    "autotune",
    "cuda_core",
    "fingerprint",
    "make_key",
    "memoize",
    "ninetoothed",
    "nvrtc",
    "stores",
    "tilelang",
    "toolchain",
    "triton",
]


del TYPE_CHECKING


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'kernelcache' has no attribute {name!r}") from None
    # Integrations raise ImportError naming the extra to install (kernelcache._extras).
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
