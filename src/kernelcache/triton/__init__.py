"""Triton's cache, backed by kernelcache: ``TRITON_CACHE_MANAGER=kernelcache.triton:CacheManager``.

Triton's default ``FileCacheManager`` writes a compile's files one by one
into a directory, so a concurrent writer can mix one compile's cubin with
another's metadata (Triton PR #11319, all-NaN outputs in vLLM #52413); it
never evicts (15 GB+ after autotuning, inode quotas exhausted on Lustre),
keeps no statistics, and every process starting together compiles every
kernel itself. Here a Triton *group* (every file of one compile plus its
``__grp__`` index) is ONE kernelcache entry, published atomically with all
its files, under the size cap, eviction and counters of a
:class:`~kernelcache.Cache`, and compiled once across processes and machines.

How ``triton.compile`` drives a manager (3.9): ``get_group(name)`` first;
on a miss ``put(data, file)`` for every stage, then ``put_group(name,
{file: path})``. The autotuner and the launcher builder (``runtime/build.py``)
instead call ``get_file`` then a lone ``put``. So a manager that was asked
``get_group`` buffers its puts in a private staging directory until
``put_group`` publishes the group (:mod:`~kernelcache.triton.pending`, which
also holds the key's single-flight claim in between); any other put is
published at once.

Configuration (:mod:`~kernelcache.triton.config`): the cache lives in
``KERNELCACHE_TRITON_DIR`` if set, else in Triton's ``TRITON_CACHE_DIR`` (or
``triton.knobs.cache.dir``) if set, else in the shared kernelcache directory;
``KERNELCACHE_TRITON_MAX_SIZE`` caps it; ``KERNELCACHE_TRITON_NAMESPACE`` is
mixed into every key, so two setups sharing one directory can be kept apart;
``KERNELCACHE_TRITON_TIMEOUT`` (seconds, default 300) bounds how long a
compile holds its claim and how long the others wait for it;
``KERNELCACHE_REMOTE`` adds the team's Redis tier.

Versions: the manager was tested on Triton :data:`TESTED` (a cell of the
version matrix per release, ``scripts/matrix.cells``) and needs the names in
:data:`SEAMS`. Triton loads it by name, so it cannot refuse a release;
:func:`support` says what kernelcache makes of the installed one. Triton's own
key (its version and compiler hashes included) is in every key: releases never
share an entry.
"""

from __future__ import annotations

from kernelcache._extras import missing

try:  # the dependency first: without it, say what to install
    import triton.runtime.cache  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing(exc, package="triton", extra="triton", feature="kernelcache.triton") from exc

from kernelcache.triton.config import (
    ENV_DIR,
    ENV_MAX_SIZE,
    ENV_NAMESPACE,
    ENV_TIMEOUT,
    Setup,
    counters,
    current,
    entry_key,
    get_cache,
    set_cache,
    stats,
)
from kernelcache.triton.manager import GROUP_PREFIX, CacheManager
from kernelcache.triton.remote import RemoteBackend
from kernelcache.versions import Range, Seam, Support, decide

#: Triton releases the manager was tested on.
TESTED = Range("3.4", "3.9")
#: What the manager needs of the installed Triton (``triton.knobs``, 3.4+, is read when there).
SEAMS: tuple[Seam, ...] = (
    "triton.runtime.cache:CacheManager",
    "triton.runtime.cache:FileCacheManager",
    "triton.runtime.cache:RemoteCacheBackend",
)


def support(version: str | None = None) -> Support:
    """What kernelcache makes of ``version`` of Triton (default: the installed one)."""
    import triton

    return decide("Triton", version or triton.__version__, TESTED, SEAMS)


__all__ = [
    "ENV_DIR",
    "ENV_MAX_SIZE",
    "ENV_NAMESPACE",
    "ENV_TIMEOUT",
    "GROUP_PREFIX",
    "SEAMS",
    "TESTED",
    "CacheManager",
    "RemoteBackend",
    "Setup",
    "counters",
    "current",
    "entry_key",
    "get_cache",
    "set_cache",
    "stats",
    "support",
]
