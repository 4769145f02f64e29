"""The S3 tier: :class:`S3Store` (``store.py``), SigV4 (``sigv4.py``), URL and credentials (``config.py``).

It shares the object tiers' core (records, streaming, verification, the
guarded call) with the HTTP tier: :mod:`kernelcache.stores.http.objects`.
"""

from __future__ import annotations

from kernelcache.stores.s3.store import S3Store

__all__ = ["S3Store"]
