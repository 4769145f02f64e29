"""kernelcache as JAX's persistent compilation cache: ``kernelcache.jax.install()``.

>>> import kernelcache.jax
>>> kernelcache.jax.install()          # before the first jax.jit call compiles
>>> f = jax.jit(f)

Or, for a job whose script cannot change: ``KERNELCACHE_JAX=1`` in its
environment (:mod:`kernelcache._jax_autoload`, called by JAX through its
``jax_plugins`` entry points before the first compile).

After :func:`install`, JAX's persistent cache reads and writes through
kernelcache's tiers (memory, the local directory or SQLite file, the team's
Redis): each executable verified, under the cap, counted in ``kernelcache
stats``, labelled ``jax_cache`` in ``kernelcache show``, keyed with what
JAX's own key leaves out (:mod:`kernelcache.jax.keys`), and compiled once
when N processes or machines miss it together (:mod:`kernelcache.jax.backend`).
The seam is the one JAX's own tests use: the module global
``jax._src.compilation_cache._cache``, set after ``reset_cache()``.

Safe by default: a serialized executable is machine code, so an entry from
the team tier is code that will run. Without ``KERNELCACHE_SECRET`` the team
tier is not read (one warning line) unless ``trust_unsigned=True`` or
``KERNELCACHE_JAX_TRUST_UNSIGNED=1``; with a secret, the Redis tier loads only
entries signed with it. The local tiers are trusted by kernelcache's
directory trust rule.

JAX's switches keep their meaning: ``jax_enable_compilation_cache=False``
turns the persistent cache off, kernelcache included; the thresholds
``jax_persistent_cache_min_compile_time_secs`` (1 s) and
``jax_persistent_cache_min_entry_size_bytes`` keep JAX's defaults (a module
that compiles in milliseconds costs less to compile again than to fetch and
verify); ``jax_compilation_cache_check_contents=True`` wraps kernelcache in
JAX's own verifying cache; after :func:`uninstall`, ``jax_compilation_cache_dir``
is JAX's own directory cache again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from kernelcache._extras import missing

try:
    import jax as _jax
except ModuleNotFoundError as exc:
    raise missing(exc, package="jax", extra="jax", feature="kernelcache.jax") from exc

from kernelcache.bytecache import Service, trusted
from kernelcache.cache import DEFAULT_TIMEOUT, Cache
from kernelcache.integration import Integration
from kernelcache.jax import keys
from kernelcache.patching import Patches
from kernelcache.versions import Range, Seam

__all__ = [
    "SEAMS",
    "TESTED",
    "enabled",
    "get_cache",
    "install",
    "installed",
    "stats",
    "uninstall",
]

logger = logging.getLogger("kernelcache.jax")

#: JAX releases the backend was tested on (0.11 needs Python 3.12; tested on 3.11).
TESTED = Range("0.6", "0.10")
COUNTERS = ("hits", "misses", "waits", "puts", "unusable", "team_refused")
#: Opt-in to reading a team tier whose entries are not signed.
TRUST_UNSIGNED = "KERNELCACHE_JAX_TRUST_UNSIGNED"
# The seams, read from JAX 0.6.2 and 0.10.2: the cache global and its reset,
# the compressor (probed for the key), the interface, the compile-ended event,
# and which process writes.
CACHE_MODULE = "jax._src.compilation_cache"
CACHE_GLOBAL = "_cache"
#: What :func:`install` needs of the installed JAX (probed, whatever its version).
SEAMS: tuple[Seam, ...] = (
    f"{CACHE_MODULE}:{CACHE_GLOBAL}",
    f"{CACHE_MODULE}:reset_cache",
    f"{CACHE_MODULE}:compress_executable",
    "jax._src.compilation_cache_interface:CacheInterface",
    "jax._src.dispatch:BACKEND_COMPILE_EVENT",
    "jax._src.distributed:global_state",
    "jax.monitoring:register_event_duration_secs_listener",
)


def jax_version() -> str:
    return str(_jax.__version__)


def _hook(patches: Patches) -> None:
    from kernelcache.jax import backend

    cc = importlib.import_module(CACHE_MODULE)
    service = Service(
        _safe_cache,
        _state.count,
        _timeout,
        key=_key,
        meta=_meta,
        name="jax",
        usable=_setup().readable,
        leads=_writes_here,
    )
    patches.on_restore(service.close)
    patches.on_restore(backend.listen(service))
    ours = _checked(cc, backend.Backend(lambda: service, _where()))
    cc.reset_cache()  # JAX's own directory cache, if it made one, is dropped
    setattr(cc, CACHE_GLOBAL, ours)

    def give_back() -> None:
        # Only ours: a cache the user set since stays. After the reset JAX builds
        # its own from jax_compilation_cache_dir at the next compile.
        if getattr(cc, CACHE_GLOBAL) is ours:
            cc.reset_cache()

    patches.on_restore(give_back)


def _checked(cc: Any, ours: Any) -> Any:
    """JAX's verifying wrapper around ``ours`` when ``jax_compilation_cache_check_contents``
    is on (JAX 0.10 wraps its own directory cache the same way)."""
    check = getattr(cc.config, "compilation_cache_check_contents", None)  # JAX 0.10
    wrapper = getattr(cc, "VerificationCache", None)
    if check is not None and check.value and wrapper is not None:
        return wrapper(ours)
    return ours


_state = Integration("jax", tool="jax", tested=TESTED, seams=SEAMS, counters=COUNTERS, hook=_hook)


def installed() -> bool:
    """Whether JAX's persistent cache is kernelcache now."""
    return _state.installed()


def install(
    cache: Cache | None = None, *, trust_unsigned: bool | None = None, timeout: float | None = None
) -> bool:
    """Make kernelcache JAX's persistent cache; ``False`` (and a warning) for another JAX.

    ``cache`` defaults to ``kernelcache.Cache()``. ``trust_unsigned=True``
    reads a team tier without ``KERNELCACHE_SECRET`` (its entries are code:
    only for a Redis that only trusted machines can write); default: the
    ``KERNELCACHE_JAX_TRUST_UNSIGNED`` variable. ``timeout``: how long a
    process waits for another's compile of the same module (default 300 s).
    Calling it again replaces the cache and options.
    """
    options = {"trust_unsigned": trust_unsigned, "timeout": timeout}
    return _state.install(jax_version(), cache, options)


def uninstall() -> None:
    """Give JAX its own persistent cache back (``jax_compilation_cache_dir``, if set)."""
    _state.uninstall()


@contextlib.contextmanager
def enabled(cache: Cache | None = None, **options: Any) -> Iterator[bool]:
    """``with kernelcache.jax.enabled(): ...`` installs for the block, then restores
    exactly what was before it."""
    with _state.enabled(lambda: install(cache, **options)) as done:
        yield done


def get_cache() -> Cache:
    """The cache given to :func:`install` (``kernelcache.Cache()`` by default)."""
    return _state.get_cache()


def stats() -> dict[str, int]:
    """This process's hits, misses, waits for another's compile, puts, unusable entries,
    and refusals of an unsigned team tier."""
    return _state.counters.snapshot()


@functools.cache
def _setup() -> keys.Setup:
    return keys.Setup.probe()


def _key(jax_key: str) -> str:
    return keys.entry_key(_setup(), jax_key)


def _meta(jax_key: str) -> dict[str, Any]:
    # JAX's key starts with the module's name (jit_f-<digest>): the label people read.
    return {"jax_cache": "executable", "jax_key": jax_key, **_setup().fields()}


def _writes_here() -> bool:
    """Whether this process writes JAX's cache: JAX puts from process 0 only, so another
    process that took the claim would make process 0 wait for a put that never comes."""
    from jax._src import distributed

    return int(distributed.global_state.process_id) == 0


def _where() -> str:
    local = [t.local_dir for t in _state.get_cache().tiers if t.local_dir is not None]
    return f"kernelcache ({local[0] if local else 'no local tier'})"


def _timeout() -> float:
    timeout = _state.option("timeout")
    return DEFAULT_TIMEOUT if timeout is None else float(timeout)


def _trust_unsigned() -> bool:
    trust = _state.option("trust_unsigned")
    return os.environ.get(TRUST_UNSIGNED) == "1" if trust is None else bool(trust)


def _safe_cache() -> Cache:
    return _state.derived("safe_cache", lambda: trusted(get_cache(), _trust_unsigned(), _refused))


def _refused() -> None:
    _state.count("team_refused")
    logger.warning(
        "kernelcache.jax: not using the team tier without KERNELCACHE_SECRET "
        "(JAX's executables are code); set the team's secret, or %s=1 to trust it",
        TRUST_UNSIGNED,
    )
