"""What every CLI command shares: the Cache a user's settings describe, and its checks."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kernelcache.cache import Cache
from kernelcache.errors import KernelCacheError, ReadOnlyStoreError
from kernelcache.settings import Settings
from kernelcache.stats.recorder import tier_names
from kernelcache.stores.base import Store
from kernelcache.tiers import SQLITE_FILE


class NoCache(KernelCacheError):
    """The directory holds no cache: a typo in ``--dir`` or ``KERNELCACHE_DIR``, most likely."""


def open_cache(settings: Settings, *, write: bool) -> Cache:
    """The tiers ``Cache()`` opens with ``settings`` (same directory, caps, remote tier).

    Read-only unless the command writes, so that looking never changes the
    cache (no layout created, no access times refreshed). ``disable`` is
    ignored: the command line manages the cache even while programs skip it.
    Statistics of the command's own lookups are not recorded.
    """
    settings = settings.replaced(disable=False, read_only=settings.read_only or not write)
    return Cache(settings=settings, persist_stats=False)


def named(tiers: Sequence[Store]) -> list[tuple[str, Store]]:
    """``(name, tier)`` pairs, named as the statistics name them (disk, redis, ...)."""
    return list(zip(tier_names(list(tiers)), tiers, strict=True))


def has_local_cache(settings: Settings) -> bool:
    """Whether the settings' directory holds a cache of the configured local tier."""
    if settings.local == "sqlite":
        return os.path.isfile(os.path.join(settings.dir, SQLITE_FILE))
    return os.path.isdir(os.path.join(settings.dir, "v1"))


def require_cache(settings: Settings, *, remote: bool) -> None:
    """Raise :class:`NoCache` when there is nothing to work on: no cache in the directory
    and (``remote``: the command would also use it) no team tier either.

    Before issue 20, ``kernelcache --dir /tmp/typo ls`` printed an empty list, rc 0.
    """
    if has_local_cache(settings) or (remote and settings.remote):
        return
    where = "exists but holds none" if os.path.isdir(settings.dir) else "does not exist"
    raise NoCache(
        f"no cache at {settings.dir} (the directory {where}); "
        "check --dir or KERNELCACHE_DIR, or `kernelcache config`"
    )


def targets(tiers: Sequence[Store], *, remote: bool) -> list[Store]:
    """The tiers a command that removes entries works on: the local ones, and the
    shared (team) tier only when the user asked with ``--remote`` (issue 20)."""
    return [t for t in tiers if not t.in_process and (remote or not t.shared)]


def refuse_read_only(tiers: Sequence[Store], what: str) -> None:
    """Raise :class:`ReadOnlyStoreError` when any of ``tiers`` is read-only: a command
    that changes the cache says so rather than report a change that did not happen."""
    stuck = [f"{name} {tier!r}" for name, tier in named(tiers) if tier.read_only]
    if stuck:
        raise ReadOnlyStoreError(
            f"the cache is read-only ({', '.join(stuck)}: KERNELCACHE_READONLY, or the "
            f"remote URL's readonly=1); {what}"
        )
