"""kernelcache as torch.compile's cache: ``kernelcache.inductor.install()``.

Skeleton: the life cycle (install, uninstall, enabled, stats) in the shape all
integrations share (:mod:`kernelcache.integration`). The FX graph,
AOTAutograd and autotune caches follow; the C++ kernel, precompiled-header and
ISA-probe caches live in :mod:`kernelcache.inductor.cpp`, whose hooks this
module installs when that module is present.

Interface with :mod:`kernelcache.inductor.cpp`: it defines
``install(patches: Patches, get_cache: Callable[[], Cache]) -> None``, which
registers every change it makes in ``patches`` (so :func:`uninstall` undoes
them) and calls ``get_cache()`` when it needs the cache (a later
:func:`install` may bring another one).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from kernelcache._extras import missing

try:
    import torch as _torch
except ModuleNotFoundError as exc:
    raise missing(exc, package="torch", extra="inductor", feature="kernelcache.inductor") from exc

from kernelcache.cache import Cache
from kernelcache.integration import Integration
from kernelcache.patching import Patches

__all__ = [
    "SUPPORTED_VERSIONS",
    "enabled",
    "get_cache",
    "install",
    "installed",
    "stats",
    "uninstall",
]

#: torch versions whose cache internals the hooks were read from.
SUPPORTED_VERSIONS = ("2.13.0",)
COUNTERS = ("hits", "misses", "puts")
CPP_MODULE = "kernelcache.inductor.cpp"


def torch_version() -> str:
    """torch's release without the local build tag (``2.13.0+cpu`` -> ``2.13.0``)."""
    return str(_torch.__version__).split("+", 1)[0]


def _hook(patches: Patches) -> None:
    try:
        cpp = importlib.import_module(CPP_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != CPP_MODULE:
            raise
        return
    cpp.install(patches, _state.get_cache)


_state = Integration(
    "inductor", tool="torch", supported=SUPPORTED_VERSIONS, counters=COUNTERS, hook=_hook
)


def installed() -> bool:
    """Whether torch.compile's caches are kernelcache now."""
    return _state.installed()


def install(cache: Cache | None = None) -> bool:
    """Make kernelcache torch.compile's cache; ``False`` (and a warning) for another torch."""
    return _state.install(torch_version(), cache, {})


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
    return _state.get_cache()


def stats() -> dict[str, int]:
    return _state.counters.snapshot()
