"""The one exception hierarchy of kernelcache.

Backends translate their own errors (``OSError``, ``sqlite3.Error``, ``redis``
errors) into these at the tier boundary, so the :class:`~kernelcache.Cache` can
treat every tier failure alike: a miss plus a counter.
"""

from __future__ import annotations


class KernelCacheError(Exception):
    """Base class of every error kernelcache raises on purpose."""


class CorruptEntry(KernelCacheError):
    """Bytes that are not a complete, intact entry: truncated, bit-flipped or foreign."""


class StoreError(KernelCacheError):
    """A storage tier failed (I/O error, disk full, database locked, connection lost).

    The :class:`~kernelcache.Cache` turns it into a miss and counts it; code that
    uses a store directly sees it.
    """


class ReadOnlyStoreError(StoreError):
    """A write was attempted on a store opened read-only."""


class ConfigError(KernelCacheError, ValueError):
    """A setting or argument is invalid; raised early and never swallowed."""
