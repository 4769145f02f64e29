"""The local-directory tier: :class:`DiskStore` (``store.py``), its shards (``space.py``)
and the files it extracts for ``Entry.path()`` (``files.py``)."""

from __future__ import annotations

from kernelcache.stores.disk.store import (
    LOW_WATER,
    SHARDS,
    STALE_STAGING_SECONDS,
    SUFFIX,
    TOUCH_INTERVAL,
    DiskStore,
)

__all__ = ["LOW_WATER", "SHARDS", "STALE_STAGING_SECONDS", "SUFFIX", "TOUCH_INTERVAL", "DiskStore"]
