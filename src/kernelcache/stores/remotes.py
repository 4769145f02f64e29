"""``KERNELCACHE_REMOTE``: a space-separated list of team-tier URLs, front first (ccache's
``remote_storage``), and the one table from a URL's scheme to its tier.

``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` make a
:class:`~kernelcache.stores.redis.RedisStore`; ``s3://`` an
:class:`~kernelcache.stores.s3.S3Store`; ``http://`` and ``https://`` an
:class:`~kernelcache.stores.http.HTTPStore`. Each tier's module is imported
only when a URL names it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kernelcache.errors import ConfigError

if TYPE_CHECKING:
    from kernelcache.stores.base import Store

#: scheme -> (module, store class, URL check in that module)
_TIERS: dict[str, tuple[str, str, str]] = {
    "redis": (
        "kernelcache.stores.redis",
        "RedisStore",
        "kernelcache.stores.redis.config:validate_url",
    ),
    "s3": ("kernelcache.stores.s3", "S3Store", "kernelcache.stores.s3.config:split_s3"),
    "http": ("kernelcache.stores.http", "HTTPStore", "kernelcache.stores.http.config:split_http"),
}
_SCHEMES = {
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
    "s3": "s3",
    "http": "http",
    "https": "http",
}


def split(text: str) -> list[str]:
    """The URLs of a ``KERNELCACHE_REMOTE`` value, in order."""
    return text.split()


def _kind(url: str) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    kind = _SCHEMES.get(scheme)
    if kind is None:
        shown = url.split("?", 1)[0].split("@")[-1]
        raise ConfigError(
            f"remote URL {shown!r}: the scheme must be one of "
            f"{', '.join(s + '://' for s in _SCHEMES)}"
        )
    return kind


def validate(text: str) -> None:
    """Raise :class:`ConfigError` unless every URL of ``text`` makes a working tier."""
    urls = split(text)
    for url in urls:
        module, _sep, name = _TIERS[_kind(url)][2].partition(":")
        getattr(importlib.import_module(module), name)(url)
    if len(set(urls)) != len(urls):
        raise ConfigError("a remote URL is given twice in the list")


def make(url: str, **options: Any) -> Store:
    """The tier ``url`` names, made with ``options`` (``secret``, ``read_only``)."""
    module, cls, _check = _TIERS[_kind(url)]
    store: Store = getattr(importlib.import_module(module), cls)(url, **options)
    return store


def share_leases(tiers: list[Store]) -> None:
    """With Redis in the stack, single-flight leases stay in Redis: the object tiers
    behind it take none of their own (one lease per compile, on the fastest server)."""
    if any(tier.kind == "redis" for tier in tiers):
        for tier in tiers:
            if hasattr(tier, "leases"):
                tier.leases = False
