"""kernelcache as TileLang's kernel cache: ``kernelcache.tilelang.install()``.

>>> import kernelcache.tilelang
>>> kernelcache.tilelang.install()            # every later tilelang.compile / @tilelang.jit
>>> kernel = tilelang.compile(func, out_idx=[2], target="cuda")

After :func:`install`, each compiled kernel of TileLang's tvm_ffi, cython
and nvrtc backends (CUDA targets) is ONE kernelcache entry: published
atomically and verified, under the cache's size cap and statistics, shared
through its Redis tier, and compiled once when N processes or machines ask
for it together. Keys add the compilers and header contents TileLang's own
key leaves out (:mod:`kernelcache.tilelang.keys`). TileLang's CUDA binary
cache (nvcc's output by device code: kernels of the same code share it) is
kernelcache entries too, keyed with the compilers and headers its own key
leaves out (:mod:`kernelcache.tilelang.binaries`).
``TILELANG_DISABLE_CACHE=1`` still compiles without any cache. Autotuning
results go through :mod:`kernelcache.autotune`, keyed by GPU model
(:mod:`kernelcache.tilelang.autotune`).

The hooks replace private methods (:data:`SEAMS`), read from the releases in
:data:`TESTED`. Another release installs with one warning when every seam is
there; one lacking a seam is refused with a line naming it, and TileLang keeps
its own cache (:mod:`kernelcache.versions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kernelcache._extras import missing

try:
    import tilelang as _tilelang
except ModuleNotFoundError as exc:
    raise missing(
        exc, package="tilelang", extra="tilelang", feature="kernelcache.tilelang"
    ) from exc

from kernelcache.autotune import AutotuneCache, current_device
from kernelcache.cache import Cache
from kernelcache.integration import Integration
from kernelcache.patching import Patches
from kernelcache.tilelang import firstrun, keys, recording, shapes
from kernelcache.tilelang.autotune import TunerHooks
from kernelcache.tilelang.binaries import BinaryHooks
from kernelcache.tilelang.kernels import COUNTERS, BackendHooks
from kernelcache.versions import Range, Seam

__all__ = [
    "SEAMS",
    "TESTED",
    "enabled",
    "get_cache",
    "get_records",
    "install",
    "installed",
    "stats",
    "uninstall",
]

#: TileLang releases the hooks were tested on.
TESTED = Range("0.1.13", "0.1.15")

# The upstream names replaced, read from TileLang 0.1.13 to 0.1.15 (the table of seams;
# where a seam's shape moved, kernelcache.tilelang.shapes adapts to what is installed).
DISPATCH_MAP = "_dispatch_map"  # tilelang.cache: backend name -> KernelCache singleton
LOAD = "_load_kernel_from_disk"
SAVE = "_save_kernel_to_disk"
TUNER_LOAD = "_load_result_from_disk"
TUNER_SAVE = "_save_result_to_disk"
COMPILE_CUDA = "compile_cuda"  # tilelang.contrib.nvcc: tilelang.cuda.backend calls it by module
DEVICE_CODEGEN = "device_codegen"  # tilelang.engine.lower: called by name, before nvcc
#: What :func:`install` needs of the installed TileLang (probed, whatever its version).
SEAMS: tuple[Seam, ...] = (
    f"tilelang.cache:{DISPATCH_MAP}",
    f"tilelang.contrib.nvcc:{COMPILE_CUDA}",
    f"tilelang.engine.lower:{DEVICE_CODEGEN}",
    "tilelang.cache.cuda_binary_cache:CUDABinaryCache.load",
    "tilelang.cache.cuda_binary_cache:CUDABinaryCache.save",
    f"tilelang.autotuner.tuner:AutoTuner.{TUNER_LOAD}",
    f"tilelang.autotuner.tuner:AutoTuner.{TUNER_SAVE}",
    # Kernel parameters as JSON: upstream's (0.1.15), else TVM's reflection (0.1.13, 0.1.14).
    (shapes.DUMP_PARAMS, shapes.TVM_SAVE_JSON),
)


def _hook(patches: Patches) -> None:
    import importlib

    import tilelang.cache as tl_cache
    import tilelang.contrib.nvcc as tl_nvcc
    from tilelang.autotuner.tuner import AutoTuner
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache

    for upstream in getattr(tl_cache, DISPATCH_MAP).values():
        hooks = BackendHooks(
            upstream, getattr(upstream, LOAD), getattr(upstream, SAVE),
            _state.get_cache, _state.counters,
        )  # fmt: skip
        # The loader's shape moved in 0.1.14 (kernelcache.tilelang.shapes): probed, not versioned.
        takes_context = shapes.takes_context(getattr(upstream, LOAD))
        patches.set(upstream, LOAD, hooks.load if takes_context else hooks.load_separate)
        patches.set(upstream, SAVE, hooks.save)
    # TileLang's nvcc call, noted for the header manifest (kernelcache.tilelang.recording).
    patches.set(tl_nvcc, COMPILE_CUDA, recording.wrap_compile(getattr(tl_nvcc, COMPILE_CUDA)))
    # A first run's key, decided before the device code generation (kernelcache.tilelang.firstrun).
    # ``import tilelang.engine.lower`` names the function tilelang.engine exports, not the module.
    tl_lower = importlib.import_module("tilelang.engine.lower")
    codegen = getattr(tl_lower, DEVICE_CODEGEN)
    patches.set(tl_lower, DEVICE_CODEGEN, firstrun.wrap_codegen(codegen))
    binaries = BinaryHooks(_state.get_cache, _state.counters)
    patches.set(CUDABinaryCache, "load", classmethod(lambda cls, key, fmt: binaries.load(key, fmt)))
    patches.set(
        CUDABinaryCache,
        "save",
        classmethod(lambda cls, key, fmt, data: binaries.save(key, fmt, data)),
    )
    tuner = TunerHooks(get_records, _device)
    patches.set(AutoTuner, TUNER_LOAD, lambda self, key: tuner.load(self, key))
    patches.set(AutoTuner, TUNER_SAVE, lambda self, key, result: tuner.save(self, key, result))


_state = Integration(
    "tilelang", tool="TileLang", tested=TESTED, seams=SEAMS, counters=COUNTERS, hook=_hook
)


def installed() -> bool:
    """Whether TileLang's caches are kernelcache now."""
    return _state.installed()


def install(cache: Cache | None = None, *, device: Any = None) -> bool:
    """Make kernelcache the cache of every TileLang backend; ``False`` if this version is not supported.

    ``cache`` defaults to ``kernelcache.Cache()`` (created on first use, from
    the ``KERNELCACHE_*`` environment). ``device`` names the GPU whose model
    keys autotune records (``{"name": ..., "capability": (9, 0)}``; default:
    CUDA device 0 as torch or cuda.core sees it). Calling it again replaces
    the cache and device.
    """
    if not _state.install(_tilelang.__version__, cache, {"device": device}):
        return False
    keys.prefetch()  # the fields every key shares, derived while the user's code runs (issue 23)
    return True


def uninstall() -> None:
    """Give TileLang its own caches back (kernels already loaded stay valid)."""
    _state.uninstall()


@contextlib.contextmanager
def enabled(cache: Cache | None = None, *, device: Any = None) -> Iterator[bool]:
    """``with kernelcache.tilelang.enabled(): ...`` installs for the block, then restores
    exactly what was before it (installed or not, and with which cache and device)."""
    with _state.enabled(lambda: install(cache, device=device)) as done:
        yield done


def _device() -> Any:
    device = _state.option("device")
    return device if device is not None else current_device()


def get_cache() -> Cache:
    """The cache TileLang's kernels go to (``kernelcache.Cache()`` unless :func:`install` got one)."""
    return _state.get_cache()


def _records() -> AutotuneCache:
    from kernelcache import toolchain

    return AutotuneCache(
        _state.get_cache(),
        toolchain={"tilelang": _tilelang.__version__, "nvcc": toolchain.nvcc()},
    )


def get_records() -> AutotuneCache:
    """The autotune records TileLang's tuner reads and writes (over :func:`get_cache`)."""
    return _state.derived("records", _records)


def stats() -> dict[str, int]:
    """This process's hits, misses, compiles, unusable entries, pass-throughs and entries it
    could not store (``unpublished``), among others (:data:`kernels.COUNTERS`)."""
    return _state.counters.snapshot()
