"""``KERNELCACHE_SLOPPINESS``: what the user allows a cache to ignore, read one way everywhere.

ccache's names. Today one: ``time_macros`` lets a source that names
``__TIME__``, ``__DATE__`` or ``__TIMESTAMP__`` be cached (its binary then
holds the time of the first compile). Without it the nvcc launcher, NVRTC and
cuda.core's :func:`~kernelcache.cuda_core.header_digest` all refuse such a
source (issue 19). No imports beyond ``os``: the launcher's hit path reads it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["KNOWN", "sloppiness", "time_macros_allowed"]

KNOWN = frozenset({"time_macros"})


def sloppiness(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The words of ``KERNELCACHE_SLOPPINESS`` in ``env`` (default ``os.environ``).

    An unknown word raises ``ValueError``: a typo must not silently keep a rule.
    """
    text = (os.environ if env is None else env).get("KERNELCACHE_SLOPPINESS", "")
    words = frozenset(text.replace(",", " ").split())
    unknown = sorted(words - KNOWN)
    if unknown:
        raise ValueError(f"KERNELCACHE_SLOPPINESS: unknown value(s) {', '.join(unknown)}")
    return words


def time_macros_allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether a source naming a time macro may be cached (``KERNELCACHE_SLOPPINESS=time_macros``)."""
    return "time_macros" in sloppiness(env)
