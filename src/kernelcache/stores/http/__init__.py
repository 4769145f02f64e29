"""Object tiers over HTTP: :class:`HTTPStore` (``store.py``) and the core the S3 tier shares.

``objects.py`` is what every object tier does alike (the record format of the
Redis tier, streamed; verification; keyless rules), ``transport.py`` the
guarded call (deadline, breaker, counted errors) over :mod:`http.client`,
``config.py`` the URL options.
"""

from __future__ import annotations

from kernelcache.stores.http.store import HTTPStore

__all__ = ["HTTPStore"]
