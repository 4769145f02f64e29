"""Recording TileLang's header manifests (:mod:`kernelcache.tilelang.manifest`).

TileLang's ``compile_cuda`` is wrapped (:func:`wrap_compile`): while a
compile is :func:`capturing`, its nvcc call is noted (flags, architecture,
the code's digest: the entry's meta, :func:`meta`), and what it reads is
found: written by its own device preprocessor run where that can be asked
for (:mod:`kernelcache.tilelang.depfile`), else by nvcc's device preprocessor
runs again, started beside nvcc (:func:`discover`: ``--dryrun``, then each
run with ``-M``) on the core a one-compile process leaves idle.
After the kernel is handed back, :func:`record_later` writes the variant in
a non-daemon thread: the files under the trees the compile read, with their
digests and stat signatures, every directory of the trees (:func:`watch`),
and the key they vouch for.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kernelcache import _fs
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.keys import sha256
from kernelcache.nvcc import deps
from kernelcache.tilelang import depfile, keys
from kernelcache.tilelang.manifest import (
    _TREE_TOKEN,
    CALL_META,
    _names,
    _roots,
    _variants,
    tree_files,
)

logger = logging.getLogger(__name__)

_TIMEOUT = 600

_capture = threading.local()


def wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """``tilelang.contrib.nvcc.compile_cuda``, noting its calls while :func:`capturing`."""

    def compile_cuda(
        code: str,
        target_format: str = "ptx",
        arch: Any = None,
        options: Any = None,
        path_target: Any = None,
        verbose: bool = False,
    ) -> Any:
        calls = getattr(_capture, "calls", None)
        if calls is not None:
            decide_now()  # normally done before code generation (firstrun.wrap_codegen)
            call = describe_call(code, target_format, arch, options)
            calls.append(call)
            started = getattr(_capture, "started", None)
            if call is not None and started is not None:
                from tilelang.contrib.cc import get_cplus_compiler
                from tilelang.contrib.nvcc import get_nvcc_subprocess_env

                given, env = _as_list(options), get_nvcc_subprocess_env() or os.environ
                written = depfile.flags(target_format, given, get_cplus_compiler(), env)
                if written is not None:
                    options = [*given, *written[0]]
                _discover_early(code, call, started, written[1] if written else None)
        return original(code, target_format, arch, options, path_target, verbose)

    return compile_cuda


#: Discoveries started beside nvcc (:func:`_discover_early`), by the code's digest: the
#: thread, once it ran ``[(files read or None, the trees' directories or None)]``, and the
#: dependency file the compile writes (``None``: :func:`discover` runs instead).
_Found = tuple[list[str] | None, list[list[Any]] | None]
_EARLY: dict[str, tuple[threading.Thread, list[_Found], str | None]] = {}
_EARLY_LOCK = threading.Lock()


def _discover_early(code: str, call: dict[str, Any], started_ns: int, written: str | None) -> None:
    """Find what a compile about to run reads, beside nvcc, then :func:`watch`.

    With ``written``, the compile's own preprocessor run writes the files it read
    there (:mod:`kernelcache.tilelang.depfile`), read once the kernel is handed back.
    Else :func:`discover` runs the preprocessor again: ~0.2 s of CPU, on a core
    a one-compile process leaves idle (and a process waiting for this compile
    elsewhere leaves idle), instead of keeping the process alive after its
    kernel was handed back. The trees' directories are listed here too
    (~10 ms): a directory changed since the walk started (``started_ns``) is
    refused as it would be later, and one changed after the listing shows at
    the lookup, by its stat. :func:`record` takes the answers.
    """
    holder: list[_Found] = []

    def run() -> None:
        try:
            read = None if written else discover(code, call)
            roots = _roots()
            listed = (read is not None or written) and roots
            holder.append((read, watch(roots, started_ns) if listed else None))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            logger.info("kernelcache: no TileLang header manifest (%s)", exc)
            holder.append((None, None))

    thread = threading.Thread(target=run, name="kernelcache-tilelang-deps", daemon=True)
    with _EARLY_LOCK:
        _EARLY[call["code"]] = (thread, holder, written)
    thread.start()


def _early_result(code_digest: object) -> _Found | None:
    """``(files read, directories)`` from a discovery started beside nvcc, if one was;
    ``None`` also when the compile was to write its dependency file and did not."""
    with _EARLY_LOCK:
        found = _EARLY.pop(code_digest, None) if isinstance(code_digest, str) else None
    if found is None:
        return None
    thread, holder, written = found
    thread.join()
    read, dirs = holder[0] if holder else (None, None)
    if written is None:
        return read, dirs
    read = depfile.read(written)
    return None if read is None else (read, dirs)


def _as_list(options: Any) -> list[str]:
    """TileLang's ``options``: a string, a list or ``None``."""
    return [options] if isinstance(options, str) else list(options or [])


def describe_call(code: str, target_format: str, arch: Any, options: Any) -> dict[str, Any] | None:
    """The call as entry meta, or ``None`` when its flags are not all known here."""
    if isinstance(options, str):
        options = [options]
    if isinstance(arch, str):
        arch = ["-arch", arch]
    if not isinstance(arch, list) or not isinstance(options, list | type(None)):
        return None  # arch=None: TileLang derives it from the current target
    folders = {f"-I{keys.headers_folder(label)}": label for label in keys.HEADER_TREES}
    return {
        "format": target_format,
        "arch": [str(a) for a in arch],
        "options": [_TREE_TOKEN + folders[o] if o in folders else str(o) for o in options or []],
        "code": sha256(code.encode()).hexdigest(),
    }


@contextlib.contextmanager
def capturing(
    started: int | None = None, decide: Callable[[], int | None] | None = None
) -> Iterator[list[dict[str, Any] | None]]:
    """Note the nvcc calls this thread's TileLang makes in the block; with ``started``
    (a manifest will be recorded, its key's walk started then), find what each reads
    while it compiles. ``decide`` is called once, before the device code generation
    (:func:`decide_now`), and its answer replaces ``started``
    (:mod:`kernelcache.tilelang.firstrun`)."""
    calls: list[dict[str, Any] | None] = []
    _capture.calls = calls
    _capture.started = started
    _capture.decide = decide
    try:
        yield calls
    finally:
        _capture.calls = None
        _capture.started = None
        _capture.decide = None


def noted() -> list[dict[str, Any] | None] | None:
    """The nvcc calls :func:`capturing` is noting in this thread (``None``: it is not)."""
    return getattr(_capture, "calls", None)


def decide_now() -> None:
    """Run the pending ``decide`` of :func:`capturing`, once; it may raise, ending the compile."""
    decide = getattr(_capture, "decide", None)
    if decide is not None:
        _capture.decide = None
        _capture.started = decide()


def meta(calls: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Entry meta for one compile: its nvcc call, if it made exactly one that is known."""
    if len(calls) != 1 or calls[0] is None:
        return {}
    return {CALL_META: {**calls[0], "compiled_ns": time.time_ns()}}


# --- recording ---------------------------------------------------------------

#: Threads that run after kernels were handed back (:func:`in_background`: entries being
#: published, manifests being recorded), for :func:`wait`.
RECORDING: list[threading.Thread] = []


#: An entry compiled this recently (by another process) is having its manifest recorded
#: by its compiler: a process that found it by the walk does not record it again.
FRESH_NS = 60_000_000_000


def walk_start(cache: Cache, pre: str | None, started_ns: int | None) -> int | None:
    """When the key's walk started, if this lookup's manifest is to be recorded; ``None``
    without a pre-key (a backend without manifests), after a manifest hit (no walk) and
    in a read-only cache. What :func:`capturing` and :func:`record_later` take."""
    return started_ns if pre is not None and not cache.settings.read_only else None


def record_later(
    cache: Cache, pre: str | None, key: str, entry: Entry, started_ns: int | None, compiled: bool
) -> None:
    """Record ``entry``'s manifest in a background thread (see the module docstring).

    After this process's compile, always; after a hit by the walk, unless the
    entry is fresh from another process (N processes that waited for one
    compile would otherwise all run nvcc's preprocessor for the same manifest).
    Nothing when :func:`walk_start` says none is to be recorded.
    """
    job = _recording(cache, pre, key, entry, started_ns, compiled)
    if job is not None:
        in_background(job)


def record_now(
    cache: Cache, pre: str | None, key: str, entry: Entry, started_ns: int | None, compiled: bool
) -> None:
    """:func:`record_later` in this thread (one that runs after the kernel was handed back)."""
    job = _recording(cache, pre, key, entry, started_ns, compiled)
    if job is not None:
        job()


def _recording(
    cache: Cache, pre: str | None, key: str, entry: Entry, started_ns: int | None, compiled: bool
) -> Callable[[], None] | None:
    """The recording of ``entry``'s manifest, or ``None`` when none is to be recorded."""
    call = entry.meta.get(CALL_META)
    started_ns = walk_start(cache, pre, started_ns)
    if pre is None or started_ns is None or not isinstance(call, dict):
        return None
    born = call.get("compiled_ns")
    if not compiled and type(born) is int and 0 <= time.time_ns() - born < FRESH_NS:
        return None
    return functools.partial(_record_logged, cache, pre, key, entry, call, started_ns)


def in_background(job: Callable[[], object], name: str = "kernelcache-tilelang-manifest") -> None:
    """Run ``job`` in a non-daemon thread (the process ends after it) that :func:`wait` joins."""
    thread = threading.Thread(target=job, name=name)
    RECORDING[:] = [t for t in RECORDING if t.is_alive()] + [thread]
    thread.start()


def wait() -> None:
    """Wait for what runs after kernels are handed back: entries being published, then
    their manifests being recorded (tests, benchmarks)."""
    for thread in list(RECORDING):
        thread.join()


def _record_logged(*args: Any) -> None:
    try:
        record(*args)
    except (OSError, ValueError, KeyError, TypeError, CorruptEntry, StoreError) as exc:
        logger.info("kernelcache: no TileLang header manifest (%s)", exc)
    except subprocess.SubprocessError as exc:  # nvcc's preprocessor timed out
        logger.info("kernelcache: no TileLang header manifest (%s)", exc)


def record(
    cache: Cache, pre: str, key: str, entry: Entry, call: dict[str, Any], started_ns: int
) -> bool:
    """Store a variant saying ``key`` holds while the files the compile read hold."""
    source = entry[entry.meta["device_source"]]
    if sha256(source).hexdigest() != call.get("code"):
        return False  # not the code the captured call compiled
    early = _early_result(call.get("code"))
    read, dirs = early if early is not None else (discover(source.decode(), call), None)
    roots = _roots()
    if read is None or not roots:
        return False
    files = tree_files(read, roots)
    if files is None:
        return False
    recorded = deps.record(files, None, started_ns)
    if early is None:
        dirs = watch(roots, started_ns)
    if recorded is None or dirs is None:
        return False  # a header changed while the key was derived: no vouching for it
    try:
        kept = _variants(cache.get(pre), roots)[0]
    except (CorruptEntry, StoreError):
        kept = []
    variants = deps.add_variant(kept, recorded[0], dirs, key)
    cache.put(pre, Entry({deps.MANIFEST: json.dumps(variants).encode()}))
    return True


def watch(roots: list[str], started_ns: int) -> list[list[Any]] | None:
    """``[folder, signature, names digest]`` of every directory of the trees (links not followed)."""
    out: list[list[Any]] = []
    now = time.time_ns()
    for root in roots:
        for folder, _subdirs, _files in os.walk(root):
            st = os.stat(folder)
            if max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns - deps.RACE_SLOP_NS:
                return None
            sig = None if _fs.too_new(st, now) else deps.signature(st)
            out.append([folder, sig, _names(folder)])
    return out


def discover(code: str, call: dict[str, Any]) -> list[str] | None:
    """Every file nvcc's preprocessor runs read for this compile (``None``: unknown)."""
    from tilelang.contrib.cc import get_cplus_compiler
    from tilelang.contrib.nvcc import get_nvcc_compiler, get_nvcc_subprocess_env

    from kernelcache.nvcc import args, preprocess

    options = []
    for option in call["options"]:
        if option.startswith(_TREE_TOKEN):
            folder = keys.headers_folder(option[len(_TREE_TOKEN) :])
            if folder is None:
                return None
            option = f"-I{folder}"
        options.append(option)
    with tempfile.TemporaryDirectory(prefix="kernelcache-tilelang-deps-") as tmp:
        source = os.path.join(tmp, "tvm_kernels.cu")
        with open(source, "w") as f:
            f.write(code)
        # TileLang's compile_cuda command line (tilelang/contrib/nvcc.py, 0.1.15).
        argv = [f"-ccbin={get_cplus_compiler()}", f"--{call['format']}", "-O3", "-lineinfo"]
        argv += [*call["arch"], *options, "-o", os.path.join(tmp, "out"), source]
        env = get_nvcc_subprocess_env() or os.environ
        planned = preprocess.commands(get_nvcc_compiler(), args.parse(argv, env), env)
        if planned is None:
            return None
        read: list[str] = []
        for command in planned[0]:
            proc = subprocess.run(
                [*command, "-M"], capture_output=True, env=planned[1], timeout=_TIMEOUT
            )
            if proc.returncode != 0:
                return None
            read += deps.parse_depfile(proc.stdout)[1]
    return read
