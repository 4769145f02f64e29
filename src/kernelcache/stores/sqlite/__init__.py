"""The single-file tier: :class:`SQLiteStore` (``store.py``) and the handling of its
database file (``file.py``: open, schema, recovery, forks)."""

from __future__ import annotations

from kernelcache.stores.sqlite.store import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    TOUCH_INTERVAL,
    SQLiteStore,
)

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "TOUCH_INTERVAL", "SQLiteStore"]
