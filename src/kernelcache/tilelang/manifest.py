"""Header manifests: a TileLang kernel hit in a fresh process without walking the header trees.

A kernel's key (:func:`kernelcache.tilelang.keys.kernel_key`) holds the
content fingerprints of two whole header trees (~1,200 files): a fresh
process pays a ``stat`` walk over all of them (issue 23). An add kernel's
device source reads ~30 of them. So, as the nvcc launcher's direct mode
(:mod:`kernelcache.nvcc.deps`) and ccache's do, a *manifest* is stored under
the *pre-key* (:func:`~kernelcache.tilelang.keys.pre_key`: the key without
the trees' contents, with their folders), holding variants: the files under
the trees the compile read, each with its content digest and stat signature;
every directory of the trees with its stat signature and a digest of its
names; and the key of the entry they vouch for. A lookup checks a variant (a
``stat`` per file, hashed only when its signature changed; a ``stat`` per
directory, listed only when it changed) and, when it holds, gets that key:
no walk. Without a manifest or a matching variant, the walk decides, as before.

*What the compile read* is asked of the compiler, never guessed: ``nvcc
--dryrun`` of TileLang's own compile (its flags, captured when it ran and
kept in the entry's meta) gives the device preprocessor runs nvcc makes (one
per device architecture, ``-D__CUDA_ARCH__=900`` and the feature macros), and
each is run again with ``-M``: exactly the headers the device code read (the
kernel's only nvcc output here is device code). That costs ~0.25 s of CPU:
it starts beside nvcc when TileLang calls it, on the core a one-compile
process leaves idle, and the manifest is written in a background thread
after the kernel was handed back (non-daemon: a short process still leaves
its manifest, at exit; it rarely waits, the preprocessor runs being done).

*Headers that appear.* A header created under a tree could shadow an
included one (an earlier ``-I``) or answer a ``__has_include``; CUTLASS's
computed includes (``#include CUDA_STD_HEADER(cstdint)``) keep
:func:`kernelcache.nvcc.includes.absent` from listing the lookups exactly.
So every directory of the trees is watched instead: a new, removed or
renamed file anywhere under them misses; an edit of a file the kernel did not
read hits (the whole-tree key missed there before).

Only the ``tvm_ffi`` backend is served this way: its one nvcc run is the
device compile captured here (its host side is LLVM's, linked without
headers). The cython backend compiles a wrapper with the same ``-I`` folders
in a second run, and the nvrtc backend compiles in-process with NVRTC, whose
include lookups nvcc cannot report: both keep the walk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
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
from kernelcache.integration import Counters
from kernelcache.keys import sha256
from kernelcache.nvcc import deps
from kernelcache.tilelang import keys

logger = logging.getLogger(__name__)

#: Backends whose every header read is the one captured nvcc run (see the module docstring).
BACKENDS = ("tvm_ffi",)
#: The entry meta field holding TileLang's nvcc call (format, arch, options, the code's digest).
CALL_META = "tilelang_nvcc_call"
#: How options name a header tree in that meta: folders differ between machines.
_TREE_TOKEN = "@kernelcache-tilelang-tree:"
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
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
            if call is not None and getattr(_capture, "discover", False):
                _discover_early(code, call)
        return original(code, target_format, arch, options, path_target, verbose)

    return compile_cuda


#: Discoveries started beside nvcc (:func:`_discover_early`), by the code's digest:
#: the thread and, once it ran, ``[files read or None]``.
_EARLY: dict[str, tuple[threading.Thread, list[list[str] | None]]] = {}
_EARLY_LOCK = threading.Lock()


def _discover_early(code: str, call: dict[str, Any]) -> None:
    """Start :func:`discover` for a compile about to run, beside nvcc.

    The preprocessor runs take ~0.25 s of CPU; run while nvcc compiles, they use
    a core a one-compile process leaves idle (and a process waiting for this
    compile elsewhere leaves idle), instead of keeping the process alive after
    its kernel was handed back. :func:`record` takes the answer.
    """
    holder: list[list[str] | None] = []

    def run() -> None:
        try:
            holder.append(discover(code, call))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            logger.info("kernelcache: no TileLang header manifest (%s)", exc)
            holder.append(None)

    thread = threading.Thread(target=run, name="kernelcache-tilelang-deps", daemon=True)
    with _EARLY_LOCK:
        _EARLY[call["code"]] = (thread, holder)
    thread.start()


def _early_result(code_digest: object) -> tuple[bool, list[str] | None]:
    """``(True, files read)`` from a discovery started beside nvcc, else ``(False, None)``."""
    with _EARLY_LOCK:
        found = _EARLY.pop(code_digest, None) if isinstance(code_digest, str) else None
    if found is None:
        return False, None
    thread, holder = found
    thread.join()
    return True, holder[0] if holder else None


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
    discover: bool = False, decide: Callable[[], bool] | None = None
) -> Iterator[list[dict[str, Any] | None]]:
    """Note the nvcc calls this thread's TileLang makes in the block; with ``discover``
    (a manifest will be recorded), find what each reads while it compiles. ``decide``
    is called once, before the device code generation (:func:`decide_now`), and its
    answer replaces ``discover`` (:mod:`kernelcache.tilelang.firstrun`)."""
    calls: list[dict[str, Any] | None] = []
    _capture.calls = calls
    _capture.discover = discover
    _capture.decide = decide
    try:
        yield calls
    finally:
        _capture.calls = None
        _capture.discover = False
        _capture.decide = None


def decide_now() -> None:
    """Run the pending ``decide`` of :func:`capturing`, once; it may raise, ending the compile."""
    decide = getattr(_capture, "decide", None)
    if decide is not None:
        _capture.decide = None
        _capture.discover = decide()


def meta(calls: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Entry meta for one compile: its nvcc call, if it made exactly one that is known."""
    if len(calls) != 1 or calls[0] is None:
        return {}
    return {CALL_META: {**calls[0], "compiled_ns": time.time_ns()}}


def _roots() -> list[str]:
    return [folder for folder in keys.header_folders().values() if folder]


class _Roots:
    """The header trees' folders (real paths), for the path tests of a lookup (~140 a hit).

    Recorded paths are real paths (:func:`record`): no ``.``, ``..`` or ``//``
    to normalize, so a string test suffices on the hit path.
    """

    def __init__(self, roots: list[str]) -> None:
        self.prefixes = tuple(root + os.sep for root in roots)
        self.roots = frozenset(roots)

    def holds(self, path: object, itself: bool = False) -> bool:
        """Whether ``path`` is a normalized absolute path under a tree (``itself``: or a root)."""
        if type(path) is not str or "//" in path or "/./" in path or "/../" in path:
            return False
        if path.endswith(("/.", "/..")):
            return False
        return path.startswith(self.prefixes) or (itself and path in self.roots)


def tree_files(read: list[str], roots: list[str]) -> list[str] | None:
    """The real paths of the files under the trees among ``read``; ``None`` when one
    named under a tree is really elsewhere (a link out: it would go unchecked)."""
    out = []
    trees = _Roots(roots)
    for path in read:
        real = os.path.realpath(path)
        if trees.holds(real):
            out.append(real)
        elif trees.holds(os.path.normpath(os.path.abspath(path))):
            return None
    return out


# --- lookup ------------------------------------------------------------------


def find(cache: Cache, pre: str, counters: Counters) -> str | None:
    """The key a variant of ``pre``'s manifest vouches for now, or ``None``."""
    try:
        stored = cache.get(pre)
    except (CorruptEntry, StoreError):
        stored = None
    if stored is None:
        return None
    variants, damaged = _variants(stored, _roots())
    if damaged:
        # Never trusted, never a crash: the walk decides, and the next record replaces it.
        counters.count("bad_manifests")
        logger.warning("kernelcache: skipped a damaged or foreign TileLang header manifest")
    for variant in variants:
        if deps.matches(variant["deps"], None) and _dirs_unchanged(variant["absent"]):
            return str(variant["result"])
    return None


def _variants(stored: Entry | None, roots: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The well-formed variants of a manifest entry, and whether any part was not."""
    if stored is None:
        return [], False
    try:
        found = json.loads(stored[deps.MANIFEST])
    except (KeyError, ValueError, RecursionError, OSError, CorruptEntry):
        return [], True
    if not isinstance(found, list):
        return [], True
    trees = _Roots(roots)
    good = [v for v in found if isinstance(v, dict) and _valid(v, trees)]
    return good, len(good) != len(found)


def _valid(variant: dict[str, Any], roots: _Roots) -> bool:
    """Whether a variant has the shape :func:`record` writes, every path under the trees."""
    rows, dirs, result = variant.get("deps"), variant.get("absent"), variant.get("result")
    if not (isinstance(rows, list) and isinstance(dirs, list) and isinstance(result, str)):
        return False
    return (
        _HEX64.match(result) is not None
        and all(_row(row, roots) for row in rows)
        and all(_dir_row(row, roots) for row in dirs)
    )


def _signature(value: object) -> bool:
    # Only the shape: a foreign value in it compares unequal, and the content decides.
    return value is None or (type(value) is list and len(value) == 5)


def _row(row: object, roots: _Roots) -> bool:
    return (
        type(row) is list
        and len(row) == 3
        and roots.holds(row[0])
        and type(row[1]) is str
        and _signature(row[2])
    )


def _dir_row(row: object, roots: _Roots) -> bool:
    return (
        type(row) is list
        and len(row) == 3
        and roots.holds(row[0], itself=True)
        and _signature(row[1])
        and type(row[2]) is str
    )


def _names(folder: str) -> str:
    return hashlib.sha256("\0".join(sorted(os.listdir(folder))).encode()).hexdigest()


def _dirs_unchanged(rows: list[list[Any]]) -> bool:
    """Whether every directory of the trees holds the names it held (a ``stat`` each)."""
    stat = os.stat
    for folder, sig, names in rows:
        try:
            st = stat(folder)
            # Field by field, as deps.matches: one comparison per directory on every hit.
            if (
                sig is not None
                and st.st_mtime_ns == sig[3]
                and st.st_ino == sig[1]
                and st.st_ctime_ns == sig[4]
                and st.st_size == sig[2]
                and st.st_dev == sig[0]
            ):
                continue
            if _names(folder) != names:
                return False
        except OSError:
            return False
    return True


# --- recording ---------------------------------------------------------------

#: Threads recording manifests (:func:`record_later`), for :func:`wait`.
RECORDING: list[threading.Thread] = []


#: An entry compiled this recently (by another process) is having its manifest recorded
#: by its compiler: a process that found it by the walk does not record it again.
FRESH_NS = 60_000_000_000


def record_later(
    cache: Cache, pre: str, key: str, entry: Entry, started_ns: int, compiled: bool
) -> None:
    """Record ``entry``'s manifest in a background thread (see the module docstring).

    After this process's compile, always; after a hit by the walk, unless the
    entry is fresh from another process (N processes that waited for one
    compile would otherwise all run nvcc's preprocessor for the same manifest).
    """
    call = entry.meta.get(CALL_META)
    if not isinstance(call, dict) or cache.settings.read_only:
        return
    born = call.get("compiled_ns")
    if not compiled and type(born) is int and 0 <= time.time_ns() - born < FRESH_NS:
        return
    thread = threading.Thread(
        target=_record_logged,
        args=(cache, pre, key, entry, call, started_ns),
        name="kernelcache-tilelang-manifest",
    )
    RECORDING[:] = [t for t in RECORDING if t.is_alive()] + [thread]
    thread.start()


def wait() -> None:
    """Wait for the manifests being recorded (tests, benchmarks)."""
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
    early, read = _early_result(call.get("code"))
    if not early:
        read = discover(source.decode(), call)
    roots = _roots()
    if read is None or not roots:
        return False
    files = tree_files(read, roots)
    if files is None:
        return False
    recorded = deps.record(files, None, started_ns)
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
