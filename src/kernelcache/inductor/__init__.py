"""kernelcache as torch.compile's cache: ``kernelcache.inductor.install()``.

>>> import kernelcache.inductor
>>> kernelcache.inductor.install()          # before the first torch.compile call
>>> model = torch.compile(model)

Or, for a job whose script cannot change: ``KERNELCACHE_INDUCTOR=1`` in its
environment (:mod:`kernelcache._inductor_autoload`, run by ``import torch``).

After :func:`install`, torch's FX graph, AOTAutograd and autotune caches read
and write through kernelcache's tiers (memory, the local directory, the team's
Redis): each entry verified, under the cap, counted in ``kernelcache stats``,
and compiled once when N processes or machines miss it together
(:mod:`kernelcache.inductor.backend`). torch's own local cache under
``TORCHINDUCTOR_CACHE_DIR`` keeps working in front of it. The seams are
public: ``RemoteCache.backend_override_cls`` of the four remote-cache classes,
and the switches that turn the remote FX graph and AOTAutograd caches on,
set only where the user left them unset (``None``), and restored exactly.

Safe by default: torch's entries are pickles, so an entry from the team tier
is code. Without ``KERNELCACHE_SECRET`` the team tier is not read (one
warning line) unless ``trust_unsigned=True`` or
``KERNELCACHE_INDUCTOR_TRUST_UNSIGNED=1``; with a secret, the Redis tier loads
only entries signed with it. The local tiers are trusted by kernelcache's
directory trust rule.

torch's switches keep their meaning: ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
disables every cache, kernelcache included; ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``
keeps the FX graph (and so AOTAutograd) cache off; a fresh
``TORCHINDUCTOR_CACHE_DIR`` empties torch's local cache only.

The C++ kernel, precompiled-header and ISA-probe caches live in
:mod:`kernelcache.inductor.cpp`; its ``install(patches, get_cache)`` registers
every change in ``patches`` and calls ``get_cache()`` when it needs the cache,
which is the cache above with the trust rule already applied (a ``.so`` is code).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from kernelcache._extras import missing

try:
    import torch as _torch
except ModuleNotFoundError as exc:
    raise missing(exc, package="torch", extra="inductor", feature="kernelcache.inductor") from exc

from kernelcache.cache import DEFAULT_TIMEOUT, Cache
from kernelcache.integration import Integration
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

logger = logging.getLogger("kernelcache.inductor")

#: torch releases the hooks were tested on.
TESTED = Range("2.10", "2.15")
COUNTERS = ("hits", "misses", "waits", "puts", "unusable", "team_refused")
CPP_MODULE = "kernelcache.inductor.cpp"
#: Opt-in to reading a team tier whose entries are not signed.
TRUST_UNSIGNED = "KERNELCACHE_INDUCTOR_TRUST_UNSIGNED"
# The seams, read from torch 2.13.0: torch._inductor.remote_cache classes whose
# backend_override_cls is set, and the (config module, switch, its cache's local switch).
OVERRIDDEN = (
    "RemoteFxGraphCache",
    "RemoteAOTAutogradCache",
    "RemoteAutotuneCache",
    "RemoteBundledAutotuneCache",
)
SWITCHES = (
    ("torch._inductor.config", "fx_graph_remote_cache", "fx_graph_cache"),
    ("torch._functorch.config", "enable_remote_autograd_cache", "enable_autograd_cache"),
    ("torch._inductor.config", "autotune_remote_cache", "autotune_local_cache"),
)

#: What :func:`install` needs of the installed torch (probed, whatever its version).
SEAMS: tuple[Seam, ...] = (
    *(f"torch._inductor.remote_cache:{name}.backend_override_cls" for name in OVERRIDDEN),
    "torch._functorch._aot_autograd.autograd_cache:AOTAutogradCache.get_remote_cache",
    "torch._dynamo.callback:callback_handler.register_end_callback",
    "torch.utils._config_module:_UNSET_SENTINEL",
    "torch.utils._config_module:_ConfigEntry",  # user_override's two shapes: switches.py
    *(f"{module}:{name}" for module, name, _ in SWITCHES),
)


def torch_version() -> str:
    """torch's release without the local build tag (``2.13.0+cpu`` -> ``2.13.0``)."""
    return str(_torch.__version__).split("+", 1)[0]


def _hook(patches: Patches) -> None:
    from torch._dynamo.callback import callback_handler
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor import remote_cache

    from kernelcache.inductor import backend, switches

    service = backend.Service(_safe_cache, _state.count, _timeout)
    patches.on_restore(service.close)
    override = backend.backend_class(lambda: service)
    for name in OVERRIDDEN:
        patches.set(getattr(remote_cache, name), "backend_override_cls", override)
    # torch keeps one remote AOTAutograd cache per process (functools.cache): drop it on
    # the way in and out, so that it is built with the backend in force.
    AOTAutogradCache.get_remote_cache.cache_clear()
    patches.on_restore(AOTAutogradCache.get_remote_cache.cache_clear)
    for module, name, local in SWITCHES:
        config = importlib.import_module(module)
        if getattr(config, name) is None and getattr(config, local):
            switches.switch_on(patches, config, name)

    def compile_ended(args: Any) -> None:
        service.flights.end_compile()

    callback_handler.register_end_callback(compile_ended)
    patches.on_restore(lambda: callback_handler.remove_end_callback(compile_ended))
    _cpp_hooks(patches)


def _cpp_hooks(patches: Patches) -> None:
    try:
        cpp = importlib.import_module(CPP_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != CPP_MODULE:
            raise
        return
    cpp.install(patches, _safe_cache)  # .so files are code too: the same trust rule


_state = Integration(
    "inductor", tool="torch", tested=TESTED, seams=SEAMS, counters=COUNTERS, hook=_hook
)


def installed() -> bool:
    """Whether torch.compile's caches are kernelcache now."""
    return _state.installed()


def install(
    cache: Cache | None = None, *, trust_unsigned: bool | None = None, timeout: float | None = None
) -> bool:
    """Make kernelcache torch.compile's cache; ``False`` (and a warning) for another torch.

    ``cache`` defaults to ``kernelcache.Cache()``. ``trust_unsigned=True``
    reads a team tier without ``KERNELCACHE_SECRET`` (its entries are code:
    only for a Redis that only trusted machines can write); default: the
    ``KERNELCACHE_INDUCTOR_TRUST_UNSIGNED`` variable. ``timeout``: how long a
    process waits for another's compile of the same graph (default 300 s).
    Calling it again replaces the cache and options.
    """
    options = {"trust_unsigned": trust_unsigned, "timeout": timeout}
    return _state.install(torch_version(), cache, options)


def uninstall() -> None:
    """Give torch its own caches back, exactly as they were."""
    _state.uninstall()


@contextlib.contextmanager
def enabled(cache: Cache | None = None, **options: Any) -> Iterator[bool]:
    """``with kernelcache.inductor.enabled(): ...`` installs for the block, then restores
    exactly what was before it."""
    with _state.enabled(lambda: install(cache, **options)) as done:
        yield done


def get_cache() -> Cache:
    """The cache given to :func:`install` (``kernelcache.Cache()`` by default)."""
    return _state.get_cache()


def _timeout() -> float:
    timeout = _state.option("timeout")
    return DEFAULT_TIMEOUT if timeout is None else float(timeout)


def _trust_unsigned() -> bool:
    trust = _state.option("trust_unsigned")
    return os.environ.get(TRUST_UNSIGNED) == "1" if trust is None else bool(trust)


def _safe_cache() -> Cache:
    return _state.derived("safe_cache", _without_unsigned_team_tiers)


def _without_unsigned_team_tiers() -> Cache:
    from kernelcache.bytecache import trusted

    return trusted(_state.get_cache(), _trust_unsigned(), _refused)


def _refused() -> None:
    _state.count("team_refused")
    logger.warning(
        "kernelcache.inductor: not using the team tier without KERNELCACHE_SECRET "
        "(torch.compile entries are code); set the team's secret, or %s=1 to trust it",
        TRUST_UNSIGNED,
    )


def stats() -> dict[str, int]:
    """This process's hits, misses, waits for another's compile, puts, unusable entries,
    and refusals of an unsigned team tier."""
    return _state.counters.snapshot()
