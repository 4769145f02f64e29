"""What every CLI command shares: the Cache a user's settings describe."""

from __future__ import annotations

from kernelcache.cache import Cache
from kernelcache.settings import Settings
from kernelcache.stats.recorder import tier_names
from kernelcache.stores.base import Store


def open_cache(settings: Settings, *, write: bool) -> Cache:
    """The tiers ``Cache()`` opens with ``settings`` (same directory, caps, remote tier).

    Read-only unless the command writes, so that looking never changes the
    cache (no layout created, no access times refreshed). ``disable`` is
    ignored: the command line manages the cache even while programs skip it.
    Statistics of the command's own lookups are not recorded.
    """
    settings = settings.replaced(disable=False, read_only=settings.read_only or not write)
    return Cache(settings=settings, persist_stats=False)


def named(tiers: list[Store]) -> list[tuple[str, Store]]:
    """``(name, tier)`` pairs, named as the statistics name them (disk, redis, ...)."""
    return list(zip(tier_names(tiers), tiers, strict=True))
