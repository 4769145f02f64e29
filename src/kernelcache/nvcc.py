"""``kernelcache nvcc ARGS...``: a caching compiler launcher, like ccache for nvcc.

Usable by hand (``kernelcache nvcc -c k.cu -o k.o``) and as
``CMAKE_CUDA_COMPILER_LAUNCHER=kernelcache`` (CMake then runs
``kernelcache /path/to/nvcc ARGS...``). One source compiled with ``-c``,
``-ptx``, ``-cubin`` or ``-fatbin`` into ``-o`` (with optional ``-MD``/``-MMD``
and ``-MF``) is cached; anything else runs nvcc unchanged and is counted as
uncacheable with its reason (:mod:`kernelcache.nvcc_args`).

Keys. The *direct key* holds nvcc's identity (``--version`` and content
hashes, memoised by stat), the host compiler's identity (``-ccbin``,
``NVCC_CCBIN`` or ``gcc`` on ``PATH``: nvcc preprocesses with it), the
normalised arguments (outputs removed), the source's content, the environment
variables nvcc and gcc read (:data:`ENV_VARS`), and the working directory when
debug info is requested (it names it). The *result key* adds the content of
every dependency nvcc reported. A manifest under the direct key maps
dependency states to results (:mod:`kernelcache.nvcc_deps`), so a hit costs
one ``stat`` per dependency and no preprocessor run.

A hit writes the output and dependency file byte-identical to what nvcc
wrote on the miss (the dependency file's default target is rewritten to this
call's ``-o``) and replays nvcc's stdout and stderr. Failed compiles pass
through and are not cached. Only the standard library and the core are
imported on the hit path; ``subprocess`` and ``tempfile`` only on a miss.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from kernelcache import nvcc_deps
from kernelcache.nvcc_args import Invocation, parse

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

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
STATS_FILE = "nvcc-stats.json"
_MANIFEST = "manifest.json"


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
            _count(settings, "uncacheable", reason=inv.reason)
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
    """The disk tier exactly as :func:`kernelcache.cache.default_tiers` builds it."""
    from kernelcache.stores.disk import DiskStore

    return DiskStore(settings.dir, max_bytes=settings.max_size, read_only=settings.readonly)


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
        _count(settings, "uncacheable", reason=f"cannot read input ({type(exc).__name__})")
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
        if hit is not None and _restore(inv, hit[1], basedir):
            _count(settings, "hits", saved=float(hit[1].meta.get("compile_seconds", 0.0)))
            return 0
        return _compile(cache, settings, nvcc, args, inv, direct, basedir)
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
    if hit is None or not _restore(inv, hit[1], basedir):
        return False
    manifest, result = hit
    recorder.hit(0, direct, manifest)
    recorder.hit(0, result.key or "", result)
    recorder.flush()
    _count(settings, "hits", saved=float(result.meta.get("compile_seconds", 0.0)))
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


def result_key(direct: str, rows: list[list[Any]]) -> str:
    from kernelcache.keys import KeyBuilder

    return (
        KeyBuilder("kernelcache.nvcc.result")
        .add("direct", direct)
        .add("deps", nvcc_deps.result_rows(rows))
        .hexdigest()
    )


def _variants(manifest: Entry | None) -> list[dict[str, Any]]:
    if manifest is None:
        return []
    try:
        variants = json.loads(manifest[_MANIFEST])
    except (KeyError, ValueError):
        return []  # a foreign or damaged manifest is a miss
    return variants if isinstance(variants, list) else []


def _lookup(
    get: Callable[[str], Entry | None], direct: str, basedir: str | None
) -> tuple[Entry, Entry] | None:
    """``(manifest, result)`` of the variant whose dependencies are unchanged, or ``None``."""
    manifest = get(direct)
    for variant in _variants(manifest):
        if nvcc_deps.matches(variant.get("deps", []), basedir):
            result = get(str(variant.get("result")))
            if result is not None and manifest is not None:
                return manifest, result
    return None


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that it is never seen partially written (make trusts mtimes).

    The old file is unlinked before the rename: on ext4, renaming over (or
    truncating) a file forces a flush of the new data (``auto_da_alloc``),
    which cost ~2 ms per output here.
    """
    tmp = f"{path}.kctmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _restore(inv: Invocation, result: Entry, basedir: str | None) -> bool:
    """Write the cached outputs; ``False`` (nvcc then runs) if they cannot be written."""
    try:
        depfile = None
        if inv.depfile is not None:
            depfile = nvcc_deps.from_stored(result["depfile"], basedir)
            if not result.meta.get("explicit_target"):
                depfile = os.fsencode(inv.output or "") + depfile
        _write_atomic(inv.output or "", result["output"])
        if depfile is not None:
            _write_atomic(inv.depfile or "", depfile)
    except (OSError, KeyError, ValueError):
        return False
    _replay(result["stdout"], result["stderr"])
    return True


def _replay(stdout: bytes, stderr: bytes) -> None:
    for stream, data in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if data:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()


def _run_plain(nvcc: str, args: list[str]) -> int:
    import subprocess

    try:
        return subprocess.run([nvcc, *args], check=False).returncode
    except OSError as exc:
        print(f"kernelcache: cannot run {nvcc}: {exc}", file=sys.stderr)
        return 127


def _compile(
    cache: Cache,
    settings: Settings,
    nvcc: str,
    args: list[str],
    inv: Invocation,
    direct: str,
    basedir: str | None,
) -> int:
    """Run nvcc on a miss, pass its results through, and cache them if nothing raced."""
    import subprocess
    import tempfile

    fd, own_dep = tempfile.mkstemp(prefix="kernelcache-", suffix=".d")
    os.close(fd)
    try:
        # Without a user -MD, nvcc writes its dependency list for us in the same
        # run: no separate preprocessor pass (the output is unchanged by -MD).
        extra = ["-MD", "-MF", own_dep] if inv.depmode is None else []
        started = time.time_ns()
        try:
            proc = subprocess.run([nvcc, *args, *extra], capture_output=True, check=False)
        except OSError as exc:
            print(f"kernelcache: cannot run {nvcc}: {exc}", file=sys.stderr)
            return 127
        elapsed = (time.time_ns() - started) / 1e9
        _replay(proc.stdout, proc.stderr)
        if proc.returncode != 0:
            _count(settings, "failed")
            return proc.returncode
        why = _store(cache, nvcc, args, inv, direct, basedir, proc, own_dep, started, elapsed)
        _count(settings, "misses" if why is None else "uncacheable", reason=why)
        return 0
    finally:
        os.unlink(own_dep)


def _store(
    cache: Cache,
    nvcc: str,
    args: list[str],
    inv: Invocation,
    direct: str,
    basedir: str | None,
    proc: Any,
    own_dep: str,
    started: int,
    elapsed: float,
) -> str | None:
    """Cache a successful compile; returns why it was not cached, or ``None``."""
    from kernelcache.entry import Entry

    try:
        with open(inv.output or "", "rb") as f:
            output = f.read()
        user_dep = None
        if inv.depfile is not None:
            with open(inv.depfile, "rb") as f:
                user_dep = f.read()
        if inv.depmode is None:
            with open(own_dep, "rb") as f:
                full = f.read()
        elif inv.depmode == "-MMD":
            full = _system_deps(nvcc, args)
        else:
            full = user_dep or b""
        rows = nvcc_deps.record(nvcc_deps.parse_depfile(full)[1], basedir, started)
    except (OSError, ValueError) as exc:
        return f"outputs or dependencies unreadable ({type(exc).__name__})"
    if rows is None:
        return "an input changed during the compile"
    artifacts = {"output": output, "stdout": proc.stdout, "stderr": proc.stderr}
    if user_dep is not None:
        body = user_dep if inv.deptarget else nvcc_deps.strip_target(user_dep, inv.output or "")
        if body is None:
            return "dependency file does not start with the output name"
        artifacts["depfile"] = nvcc_deps.to_stored(body, basedir)
    meta = {"compile_seconds": round(elapsed, 6), "explicit_target": inv.deptarget}
    result = result_key(direct, rows)
    cache.put(result, Entry(artifacts, meta))
    variants = nvcc_deps.add_variant(_variants(cache.get(direct)), rows, result)
    cache.put(direct, Entry({_MANIFEST: json.dumps(variants).encode()}))
    return None


def _system_deps(nvcc: str, args: list[str]) -> bytes:
    """Full dependencies for an ``-MMD`` compile, whose own file omits system headers."""
    import subprocess

    from kernelcache.nvcc_args import dependency_only

    proc = subprocess.run([nvcc, *dependency_only(args)], capture_output=True, check=False)
    if proc.returncode != 0:
        raise ValueError("nvcc -M failed")
    return bytes(proc.stdout)


def stats_path(settings: Settings | None = None) -> str:
    from kernelcache.settings import Settings

    return os.path.join((settings or Settings.load()).dir, STATS_FILE)


def launcher_stats(settings: Settings | None = None) -> dict[str, Any]:
    """Counters of every launcher call on this cache directory (all processes)."""
    try:
        with open(stats_path(settings), "rb") as f:
            data = json.loads(f.read() or b"{}")
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def _count(settings: Settings, field: str, reason: str | None = None, saved: float = 0.0) -> None:
    """Add one to ``field`` (and to ``reasons[reason]``) in the shared stats file, under flock."""
    import fcntl

    path = stats_path(settings)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return  # statistics never fail a build
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 1 << 20, 0)
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {}
        data[field] = int(data.get(field, 0)) + 1
        if reason is not None:
            reasons = data.setdefault("reasons", {})
            reasons[reason] = int(reasons.get(reason, 0)) + 1
        if saved:
            data["seconds_saved"] = round(float(data.get("seconds_saved", 0.0)) + saved, 6)
        encoded = json.dumps(data, sort_keys=True).encode()
        # Pad instead of truncating: truncating a file with data makes ext4
        # flush it (auto_da_alloc), ~3 ms per call. JSON allows trailing spaces.
        os.pwrite(fd, encoded.ljust(len(raw)), 0)
    except OSError:
        return
    finally:
        os.close(fd)


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
    results = [str(v.get("result")) for v in _variants(cache.get(direct))]
    return sum(cache.delete(key) for key in [*results, direct])
