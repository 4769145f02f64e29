"""kernelcache as ninetoothed's cache: ``kernelcache.ninetoothed.install()``.

>>> import kernelcache.ninetoothed
>>> kernelcache.ninetoothed.install()
>>> kernel = ninetoothed.make(arrangement, application, tensors)   # memoised handle

:func:`install` (ninetoothed :data:`TESTED`) makes four changes, each undone by :func:`uninstall`:

- generated sources are written atomically and named by source and kernel
  name (:mod:`kernelcache.ninetoothed.source`): the concurrent
  generate-and-import race of ninetoothed #161 is gone;
- ``ninetoothed.build`` and AOT ``make`` outputs are kernelcache entries,
  keyed by the generated source of every config (:mod:`.outputs`), compiled
  once across processes and restored into ``output_dir`` on a hit;
- ``ninetoothed.make(..., caller="torch")`` handles are memoised in process
  with #161's content keys (:mod:`.handles`); call ``ninetoothed.make``, not a
  ``make`` imported by name before :func:`install`;
- the JIT auto-tuner's timings go through :mod:`kernelcache.autotune`, keyed
  by GPU model (:mod:`.autotune`), and Triton's own cache becomes kernelcache
  (``TRITON_CACHE_MANAGER=kernelcache.triton:CacheManager``, also seen by the
  ``triton.tools.compile`` processes of the AOT path).

Another release installs with one warning when every name in :data:`SEAMS` is
there; one lacking a seam keeps its own caches, with a line naming it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from kernelcache._extras import missing

try:
    import ninetoothed as _ninetoothed
except ModuleNotFoundError as exc:
    raise missing(
        exc, package="ninetoothed", extra="ninetoothed", feature="kernelcache.ninetoothed"
    ) from exc

from kernelcache.autotune import AutotuneCache, current_device
from kernelcache.cache import Cache
from kernelcache.integration import Integration
from kernelcache.ninetoothed import outputs, shapes, source
from kernelcache.ninetoothed.autotune import TunerHooks
from kernelcache.ninetoothed.handles import MakeMemo
from kernelcache.ninetoothed.outputs import OutputCache
from kernelcache.patching import Patches
from kernelcache.versions import Range, Seam

__all__ = [
    "SEAMS",
    "TESTED",
    "TRITON_CACHE_MANAGER",
    "enabled",
    "get_cache",
    "get_records",
    "install",
    "installed",
    "make_memo",
    "stats",
    "uninstall",
]

#: ninetoothed releases the hooks were tested on.
TESTED = Range("0.24", "0.26")
TRITON_CACHE_MANAGER = "kernelcache.triton:CacheManager"
# The upstream names replaced (read from 0.24.0 to 0.26.0): module -> attribute.
CACHE_SOURCE = ("ninetoothed.generation", "cache_source")
DEBUG_CACHE_SOURCE = ("ninetoothed.debugging", "cache_source")  # imported by name there
MAKE_AOT = ("ninetoothed.make", "aot")  # make() calls aot() through this global
GET_TIMINGS = "_get_timings"  # ninetoothed.auto_tuner.AutoTuner
#: What :func:`install` needs of the installed ninetoothed (probed, whatever its version).
SEAMS: tuple[Seam, ...] = (
    ":".join(CACHE_SOURCE),
    ":".join(DEBUG_CACHE_SOURCE),
    ":".join(MAKE_AOT),
    "ninetoothed.make:make",
    "ninetoothed.build:build",
    f"ninetoothed.auto_tuner:AutoTuner.{GET_TIMINGS}",
    f"ninetoothed.build:{outputs.GENERATE_SUFFIX}",
    f"ninetoothed.aot:{outputs.HEADER_PATH}",
    f"ninetoothed.aot:{outputs.HEADER_CONTENT}",
    # Where a seam's shape moved (0.24 -> 0.25), either shape (kernelcache.ninetoothed.shapes).
    (":".join(shapes.LOAD_LAUNCH_FUNC), ":".join(shapes.LOAD_LIBRARY)),
    (":".join(shapes.ARG_TO_INT), ":".join(shapes.MACROS)),
)
COUNTERS = ("make_hits", "make_misses", "output_hits", "output_compiles", "autotune_runs")


def _ninetoothed_version() -> str:
    from importlib.metadata import version

    return version("ninetoothed")


def _hook(patches: Patches) -> None:
    generation = importlib.import_module(CACHE_SOURCE[0])
    folder = generation.CACHE_DIR

    def cache_source(text: str, kernel_name: str | None = None) -> Any:
        return source.write_once(folder, text, kernel_name)

    for module, name in (CACHE_SOURCE, DEBUG_CACHE_SOURCE):
        patches.set(importlib.import_module(module), name, cache_source)

    build_module = importlib.import_module("ninetoothed.build")
    make_module = importlib.import_module(MAKE_AOT[0])
    output_cache = OutputCache(
        getattr(make_module, MAKE_AOT[1]), build_module.build, _state.get_cache, _state.count
    )
    patches.set(make_module, MAKE_AOT[1], output_cache.aot)
    patches.set(_ninetoothed, "build", output_cache.build)

    memo = MakeMemo(make_module.make)
    _memo[:] = [memo]
    patches.on_restore(_memo.clear)
    patches.set(_ninetoothed, "make", memo)

    tuner = TunerHooks(get_records, _device, lambda: _state.option("bench"), _state.count)
    auto_tuner = importlib.import_module("ninetoothed.auto_tuner")
    patches.set(
        auto_tuner.AutoTuner,
        GET_TIMINGS,
        lambda self, args, kwargs: tuner.get_timings(self, args, kwargs),
    )
    patches.setenv("TRITON_CACHE_MANAGER", TRITON_CACHE_MANAGER)


_state = Integration(
    "ninetoothed",
    tool="ninetoothed",
    tested=TESTED,
    seams=SEAMS,
    counters=COUNTERS,
    hook=_hook,
    keeps="its own caches",
)
_memo: list[MakeMemo] = []  # the memo behind ninetoothed.make while installed


def installed() -> bool:
    return _state.installed()


def install(
    cache: Cache | None = None,
    *,
    device: Any = None,
    bench: Callable[[Callable[[], Any]], float] | None = None,
) -> bool:
    """Make kernelcache ninetoothed's cache; ``False`` (and a warning) for an unsupported version.

    ``cache`` defaults to ``kernelcache.Cache()``; ``device`` names the GPU
    whose model keys auto-tuning records (default: CUDA device 0);
    ``bench`` times one candidate call (default ``triton.testing.do_bench``).
    Calling it again replaces the cache, device and bench.
    """
    return _state.install(_ninetoothed_version(), cache, {"device": device, "bench": bench})


def uninstall() -> None:
    """Give ninetoothed its own caches back."""
    _state.uninstall()


@contextlib.contextmanager
def enabled(cache: Cache | None = None, **options: Any) -> Iterator[bool]:
    """``with kernelcache.ninetoothed.enabled(): ...`` installs for the block, then restores
    exactly what was before it (installed or not, and with which cache and options)."""
    with _state.enabled(lambda: install(cache, **options)) as done:
        yield done


def _device() -> Any:
    device = _state.option("device")
    return device if device is not None else current_device()


def _records() -> AutotuneCache:
    from kernelcache import toolchain

    return AutotuneCache(
        _state.get_cache(),
        toolchain={"ninetoothed": _ninetoothed_version(), "triton": toolchain.triton()},
    )


def get_cache() -> Cache:
    return _state.get_cache()


def get_records() -> AutotuneCache:
    return _state.derived("records", _records)


def make_memo() -> MakeMemo | None:
    """The memo behind ``ninetoothed.make`` while installed (``.memo.cache_info()``)."""
    return _memo[0] if _memo else None


def stats() -> dict[str, int]:
    """This process's make() memo hits and misses, output hits and compiles, autotune runs."""
    counters = _state.counters.snapshot()
    memo = make_memo()
    if memo is not None:
        info = memo.memo.cache_info()
        counters["make_hits"], counters["make_misses"] = info.hits, info.misses
    return counters
