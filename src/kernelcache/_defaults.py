"""The process-wide default :class:`~kernelcache.Cache` used by the integrations.

One per effective configuration, so that in-process hits come from the memory
tier (a ``Cache()`` per call would start with an empty memory tier and
re-create the disk layout every time), while a changed ``KERNELCACHE_*``
variable still takes effect.
"""

from __future__ import annotations

import os
import threading

from kernelcache.cache import Cache
from kernelcache.settings import VARIABLES, Settings

_caches: dict[tuple[str | None, ...], Cache] = {}
_lock = threading.Lock()


def default_cache() -> Cache:
    """The shared ``Cache()`` for the current ``KERNELCACHE_*`` environment."""
    # Keyed by the raw variables: Settings.load() costs ~10 us, a third of a hit.
    environ = os.environ
    config = tuple(environ.get(name) for name in VARIABLES)
    cache = _caches.get(config)
    if cache is None:
        with _lock:
            cache = _caches.get(config)
            if cache is None:
                cache = _caches[config] = Cache(settings=Settings.load())
    return cache
