"""kernelcache: one compilation cache for GPU JIT compilers and CUDA builds.

>>> import kernelcache as kc
>>> cache = kc.Cache()  # memory + disk at KERNELCACHE_DIR (+ Redis if KERNELCACHE_REMOTE)

Names are imported on first use (PEP 562): ``kernelcache nvcc`` runs on every
build's critical path and must not pay for ``inspect`` (fingerprint) or tiers
it does not touch. Integrations (``kernelcache.nvrtc``, ``kernelcache.triton``,
...) are imported on demand; nothing here imports a compiler.
"""

from __future__ import annotations

# Not typing.TYPE_CHECKING: importing typing costs ~2 ms; mypy knows the idiom.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from kernelcache import fingerprint, toolchain
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
    from kernelcache.stores.sqlite import SQLiteStore

__version__ = "0.1.0"

# public name -> module that defines it ("" for a submodule of the same name)
_LAZY = {
    "Cache": "kernelcache.cache",
    "ConfigError": "kernelcache.errors",
    "CorruptEntry": "kernelcache.errors",
    "DiskStore": "kernelcache.stores",
    "Entry": "kernelcache.entry",
    "KernelCacheError": "kernelcache.errors",
    "KeyBuilder": "kernelcache.keys",
    "MemoryStore": "kernelcache.stores",
    "ReadOnlyStoreError": "kernelcache.errors",
    "SQLiteStore": "kernelcache.stores",
    "Settings": "kernelcache.settings",
    "Store": "kernelcache.stores",
    "StoreError": "kernelcache.errors",
    "fingerprint": "",
    "make_key": "kernelcache.keys",
    "toolchain": "",
}

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
    "toolchain",
]


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelcache' has no attribute {name!r}")
    value = (
        importlib.import_module(f"kernelcache.{name}")
        if module == ""
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
