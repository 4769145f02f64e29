"""``kernelcache nvcc ARGS...``: a caching compiler launcher, like ccache for nvcc.

Usable by hand (``kernelcache nvcc -c k.cu -o k.o``) and as
``CMAKE_CUDA_COMPILER_LAUNCHER=kernelcache`` (CMake then runs
``kernelcache /path/to/nvcc ARGS...``). One source compiled with ``-c``,
``-ptx``, ``-cubin`` or ``-fatbin`` into ``-o`` (with optional ``-MD``/``-MMD``
and ``-MF``) is cached; anything else runs nvcc unchanged and is counted as
uncacheable with its reason (:mod:`kernelcache.nvcc.args`).

Keys. The *direct key* holds nvcc's identity (``--version`` and content
hashes, memoised by stat), the host compiler's identity (``-ccbin``,
``NVCC_CCBIN`` or ``gcc`` on ``PATH``: nvcc preprocesses with it), the
normalised arguments (outputs removed), the source's content, the environment
variables nvcc and gcc read (:data:`ENV_VARS`), and the working directory when
debug info is requested (it names it). The *result key* adds the content of
every dependency nvcc reported. A manifest under the direct key maps
dependency states to results (:mod:`kernelcache.nvcc.deps`), so a hit costs
one ``stat`` per dependency and no preprocessor run.

A hit writes the output and dependency file byte-identical to what nvcc
wrote on the miss (the dependency file's default target is rewritten to this
call's ``-o``) and replays nvcc's stdout and stderr. Failed compiles pass
through and are not cached. Only the standard library and the core are
imported on the hit path; ``subprocess`` and ``tempfile`` only on a miss.

This module is the launcher's control flow, its direct key and the hit. The
rest sits beside it: arguments in :mod:`~kernelcache.nvcc.args`, dependency
files and manifests in :mod:`~kernelcache.nvcc.deps`, writing a hit's files
in :mod:`~kernelcache.nvcc.outputs`, the miss (compile, result key, store) in
:mod:`~kernelcache.nvcc.miss`, and the ``nvcc-stats.json`` counters in
:mod:`~kernelcache.stats.launcher`.
"""

from __future__ import annotations

import os
import sys

from kernelcache.nvcc import deps as nvcc_deps
from kernelcache.nvcc.args import Invocation, parse
from kernelcache.nvcc.outputs import restore
from kernelcache.stats.launcher import STATS_FILE, count, launcher_stats, stats_path

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from kernelcache.cache import Cache
    from kernelcache.entry import Entry
    from kernelcache.settings import Settings
    from kernelcache.stores.disk import DiskStore

#: Environment variables that change what nvcc (or the gcc it runs) produces.
#: PATH itself is not keyed: the host compiler it resolves to is, by identity.
ENV_VARS = (
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "NVCC_CCBIN",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "SOURCE_DATE_EPOCH",
)
# The statistics names stay importable from here (the CLI and tests use them).
__all__ = [
    "ENV_VARS",
    "STATS_FILE",
    "direct_key",
    "forget",
    "host_compiler",
    "launcher_stats",
    "main",
    "stats_path",
]


def main(argv: list[str]) -> int:
    """Run ``argv`` (``["nvcc" or "/path/to/nvcc", args...]``) through the cache."""
    if not argv:
        print(
            "usage: kernelcache nvcc ARGS...  |  kernelcache /path/to/nvcc ARGS...", file=sys.stderr
        )
        return 2
    nvcc = _resolve_compiler(argv[0])
    args = list(argv[1:])
    inv = parse(args)
    from kernelcache.errors import KernelCacheError
    from kernelcache.settings import Settings

    try:
        settings = Settings.load()
        if settings.disable:
            return _run_plain(nvcc, args)
        if inv.reason is not None:
            count(settings, "uncacheable", reason=inv.reason)
            return _run_plain(nvcc, args)
        # Without a remote tier a hit can only come from the local disk tier:
        # open that alone, and the full Cache (memory tier, statistics
        # recorder, single-flight) only on a miss. With a remote tier the
        # Cache is opened up front as before, so a bad remote setting still
        # shows here, before any work.
        disk = _disk_tier(settings) if not settings.remote else None
        cache = _open_cache(settings) if disk is None else None
    except (KernelCacheError, OSError) as exc:
        return _without_cache(nvcc, args, exc)
    try:
        return _cached(disk, cache, settings, nvcc, args, inv)
    finally:
        if disk is not None:
            disk.close()


def _disk_tier(settings: Settings) -> DiskStore:
    from kernelcache.stores.disk import DiskStore

    return DiskStore.from_settings(settings)  # the same tier default_tiers opens


def _open_cache(settings: Settings) -> Cache:
    from kernelcache.cache import Cache

    return Cache(settings=settings)


def _without_cache(nvcc: str, args: list[str], exc: BaseException) -> int:
    # A launcher must never be why a build fails: a bad KERNELCACHE_*
    # value or an unusable cache directory costs the cache, not the compile.
    print(f"kernelcache: cache unavailable, compiling without it: {exc}", file=sys.stderr)
    return _run_plain(nvcc, args)


def _cached(
    disk: DiskStore | None,
    cache: Cache | None,
    settings: Settings,
    nvcc: str,
    args: list[str],
    inv: Invocation,
) -> int:
    try:
        with open(inv.source or "", "rb") as f:
            source = f.read()
    except OSError as exc:
        count(settings, "uncacheable", reason=f"cannot read input ({type(exc).__name__})")
        return _run_plain(nvcc, args)
    basedir = _basedir()
    direct = direct_key(nvcc, inv, source)
    if disk is not None and _disk_hit(disk, settings, inv, direct, basedir):
        return 0
    if cache is None:
        from kernelcache.errors import KernelCacheError

        try:
            cache = _open_cache(settings)
        except (KernelCacheError, OSError) as exc:
            return _without_cache(nvcc, args, exc)
    try:
        hit = _lookup(cache.get, direct, basedir)
        if hit is not None and restore(inv, hit[1], basedir):
            count(settings, "hits", saved=float(hit[1].meta.get("compile_seconds", 0.0)))
            return 0
        from kernelcache.nvcc.miss import compile_and_cache

        return compile_and_cache(cache, settings, nvcc, args, inv, direct, basedir)
    finally:
        cache.close()


def _disk_hit(
    disk: DiskStore, settings: Settings, inv: Invocation, direct: str, basedir: str | None
) -> bool:
    """Serve a hit from the disk tier alone; ``False`` leaves the call to the full Cache.

    Records the statistics the Cache would have recorded for the same two
    disk hits (its memory tier is empty in a new process, so they are disk
    hits there too). On ``False`` nothing is recorded: the Cache looks again
    and counts what it finds, as if this lookup had not happened.
    """
    from kernelcache.errors import StoreError
    from kernelcache.stats import Recorder

    recorder = Recorder([disk], disk.path)
    try:
        hit = _lookup(disk.get, direct, basedir)
    except StoreError:
        return False  # counted by the Cache's own look, if its tier fails again
    if hit is None or not restore(inv, hit[1], basedir):
        return False
    manifest, result = hit
    recorder.hit(0, direct, manifest)
    recorder.hit(0, result.key or "", result)
    recorder.flush()
    count(settings, "hits", saved=float(result.meta.get("compile_seconds", 0.0)))
    return True


def _resolve_compiler(name: str) -> str:
    from kernelcache.toolchain import which

    return name if os.sep in name else (which(name) or name)


def _basedir() -> str | None:
    value = os.environ.get("KERNELCACHE_BASEDIR")
    return os.path.normpath(os.path.abspath(value)) if value else None


def host_compiler(inv: Invocation) -> str | None:
    """The host compiler nvcc will run (``-ccbin``, ``NVCC_CCBIN``, else ``gcc``)."""
    from kernelcache.toolchain import which

    value = inv.ccbin or os.environ.get("NVCC_CCBIN") or "gcc"
    if os.path.isdir(value):
        return os.path.join(value, "gcc")  # what nvcc runs for a directory (checked, 13.0)
    return value if os.sep in value else which(value)


def direct_key(nvcc: str, inv: Invocation, source: bytes) -> str:
    """The key of everything known before compiling (see the module docstring)."""
    from kernelcache import toolchain
    from kernelcache.keys import KeyBuilder, sha256

    host = host_compiler(inv)
    builder = KeyBuilder("kernelcache.nvcc.direct")
    builder.add("nvcc", toolchain.nvcc(nvcc))
    builder.add("host", toolchain.executable(host) if host else "probe_failed:FileNotFoundError")
    builder.add("args", inv.keyed)
    builder.add("source", sha256(source).digest())
    builder.add("env", {name: os.environ.get(name) for name in ENV_VARS})
    builder.add("cwd", os.getcwd() if inv.debug else None)
    return builder.hexdigest()


def _lookup(
    get: Callable[[str], Entry | None], direct: str, basedir: str | None
) -> tuple[Entry, Entry] | None:
    """``(manifest, result)`` of the variant whose dependencies are unchanged, or ``None``."""
    manifest = get(direct)
    for variant in nvcc_deps.variants(manifest):
        if nvcc_deps.matches(variant.get("deps", []), basedir):
            result = get(str(variant.get("result")))
            if result is not None and manifest is not None:
                return manifest, result
    return None


def _run_plain(nvcc: str, args: list[str]) -> int:
    import subprocess

    try:
        return subprocess.run([nvcc, *args], check=False).returncode
    except OSError as exc:
        print(f"kernelcache: cannot run {nvcc}: {exc}", file=sys.stderr)
        return 127


def forget(argv: list[str], cache: Cache | None = None) -> int:
    """Drop every cached result of this command line, so its next run is cold.

    Returns how many entries (results and the manifest) were removed; ``0``
    for an uncacheable command or an unreadable source.
    """
    inv = parse(list(argv[1:]))
    if inv.reason is not None:
        return 0
    try:
        with open(inv.source or "", "rb") as f:
            direct = direct_key(_resolve_compiler(argv[0]), inv, f.read())
    except OSError:
        return 0
    if cache is None:
        from kernelcache.cache import Cache

        cache = Cache()
    results = [str(v.get("result")) for v in nvcc_deps.variants(cache.get(direct))]
    return sum(cache.delete(key) for key in [*results, direct])
