"""Keys of TileLang kernels: what TileLang keys on, plus what it leaves out.

TileLang's own key (``KernelCache._generate_key``, 0.1.15) hashes the TIR
script, ``out_idx``, the call's arguments, target, pass configs, compile
flags, its version and, only when ``TILELANG_KERNEL_CACHE_USE_LIB_STAMP`` is
set, a stamp of its native libraries. It does not name the compilers: a new
nvcc or host compiler, or an edited header under the template path, hits
binaries built by the old ones. Its binary cache keys the nvcc command line,
absolute ``-I`` paths included, so the same kernel misses in another
virtualenv. Here the upstream key is one field (it covers the call's
arguments, which the cache hook never sees), and next to it: the backend and
target kind, TileLang's version, the content of its native libraries and of
the header trees nvcc is pointed at, nvcc's and the host compiler's identity,
NVRTC's for the nvrtc backend, and the environment variables nvcc and its host
compiler read (``NVCC_APPEND_FLAGS``, ``CPATH``, ...). No field holds an
absolute path (but a variable's value may).

A fresh process finds a tvm_ffi kernel's key without walking the header
trees, through the header manifest stored under :func:`pre_key`
(:mod:`kernelcache.tilelang.manifest`); the walk stays the source of truth.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import shutil
import threading
from collections.abc import Callable
from typing import Any

from kernelcache import _fs, _memos, buildid, toolchain
from kernelcache.keys import KeyBuilder
from kernelcache.nvcc import key as nvcc_key
from kernelcache.tilelang import trees

NAMESPACE = "kernelcache.tilelang"
#: Header manifests (:mod:`kernelcache.tilelang.manifest`), a namespace of their own.
MANIFEST_NAMESPACE = "kernelcache.tilelang.manifest"
SCHEMA = 1

# The native libraries whose content decides code generation (TileLang's own stamp list).
_LIBRARIES = ("libtilelang.so", "libtvm_runtime.so", "libtvm_compiler.so", "libtvm_ffi.so")


def _env_module() -> Any:
    # ``import tilelang.env`` gives the Environment object that tilelang/__init__
    # exports under the same name, not the module that holds TL_LIBS.
    return importlib.import_module("tilelang.env")


@functools.cache
def library_stamp() -> dict[str, str]:
    """Identities of TileLang's native libraries, by file name.

    Each is the linker's digest of the library (its GNU build ID,
    :mod:`kernelcache.buildid`) and size; a library without one is hashed
    (memoised by stat). Once per process: ``import tilelang`` loaded them, so
    the code generating this process's kernels is what was read then.
    """
    tl_env = _env_module()
    stamp: dict[str, str] = {}
    for folder in tl_env.TL_LIBS:
        for name in _LIBRARIES:
            path = os.path.join(folder, name)
            if name not in stamp and os.path.isfile(path):
                stamp[name] = buildid.identity(path) or toolchain.file_digest(path)
    return stamp


#: The header trees nvcc gets as ``-I``, by label: attributes of ``tilelang.env.env``.
HEADER_TREES = {"templates": "TILELANG_TEMPLATE_PATH", "cutlass": "CUTLASS_INCLUDE_DIR"}


_tree = functools.cache(trees.tree_fingerprint)


def headers_folder(label: str) -> str | None:
    """The folder of header tree ``label`` (``TL_TEMPLATE_PATH`` / ``TL_CUTLASS_PATH`` win)."""
    folder = getattr(_env_module().env, HEADER_TREES[label])
    return str(folder) if folder else None


def headers() -> dict[str, str | None]:
    """Fingerprints of the header trees nvcc gets as ``-I`` (templates, CUTLASS)."""
    return {label: _header_tree(label) for label in HEADER_TREES}


def _header_tree(label: str) -> str | None:
    folder = _resolve(headers_folder(label))
    return _tree(folder) if folder else None


def compilers(backend: str) -> dict[str, str | None]:
    """Identity of nvcc and of the host compiler it runs, plus NVRTC for the nvrtc backend."""
    from tilelang.contrib.cc import get_cplus_compiler
    from tilelang.contrib.nvcc import get_nvcc_compiler

    try:
        nvcc = toolchain.nvcc(get_nvcc_compiler())
    except (AssertionError, RuntimeError, OSError) as exc:  # no CUDA_HOME found
        nvcc = toolchain.failed(exc)
    host = get_cplus_compiler()
    if host and os.sep not in host:
        host = shutil.which(host)
    return {
        "nvcc": nvcc,
        "host": toolchain.executable(host) if host else "probe_failed:FileNotFoundError",
        "nvrtc": toolchain.nvrtc() if backend == "nvrtc" else None,
    }


# Threads deriving the kernel-independent fields (:func:`prefetch`), joined before use.
_warming: list[threading.Thread] = []
_warming_lock = threading.Lock()
# Whether prefetch() has decided in this process: the header trees are fingerprinted
# once per process (``_tree``), so asking the memo again at each key only costs reads.
_prefetched = False
_WARM_ERRORS = (OSError, RuntimeError, ValueError, AttributeError, ImportError)


def prefetch() -> None:
    """Start deriving the fields every kernel's key shares, in background threads.

    With an empty memo (a first run, a new cache directory) they cost ~0.2 s:
    hashing the header trees, probing the compilers (issue 23).
    :func:`~kernelcache.tilelang.install` starts them, so they overlap the
    user's code until the first compile; the hashing, file reads and probes
    release the GIL, so the threads (one per header tree, one for the rest)
    overlap each other too. A header tree already in the memo is not walked
    here: a hit through its header manifest (:mod:`kernelcache.tilelang.manifest`)
    needs no walk. With every tree in the memo, no thread starts at all: the
    rest then costs ~1 ms from its memo, and a thread would only take the GIL
    from the user's code (a fresh-process hit paid ~3 ms for it). Decides once per process.
    """
    global _prefetched
    with _warming_lock:
        if _prefetched:
            return
        _prefetched = True
        labels = [label for label in HEADER_TREES if not _memoised(label)]
        jobs: list[Callable[[], object]] = [
            functools.partial(_header_tree, label) for label in labels
        ]
        if jobs:  # a first run here: the compilers are most likely unprobed too
            jobs.append(_libraries_and_compilers)
        for job in jobs:
            thread = threading.Thread(target=_warm, args=(job,), name="kernelcache-tilelang-key")
            thread.daemon = True
            _warming.append(thread)
        for thread in _warming:
            thread.start()


def _memoised(label: str) -> bool:
    folder = _real_folder(headers_folder(label))
    return folder is None or trees.memoised(folder)


def _libraries_and_compilers() -> None:
    # Of processes starting together on an empty memo, one probes the compilers
    # (and hashes a library without a build ID); the others wait, then read its memo.
    with _memos.exclusive(toolchain.MEMO_FILE):
        library_stamp()
        compilers("tvm_ffi")


def _warm(job: Callable[[], object]) -> None:
    try:
        job()
    except _WARM_ERRORS:
        return  # kernel_key derives it again, in the caller's thread, and raises there


def settled() -> bool:
    """Whether the fields :func:`prefetch` derives are ready (no thread of it still running)."""
    return not any(thread.is_alive() for thread in _warming)


def _settle() -> None:
    """Wait for :func:`prefetch` (started now if it was not), so nothing is hashed twice."""
    prefetch()
    for thread in _warming:
        thread.join()


def shared_fields(backend: str) -> dict[str, Any]:
    """The fields of every key of ``backend`` but the kernel's and the header trees':
    TileLang's version and libraries, the compilers, the environment nvcc reads
    (:func:`kernelcache.nvcc.key.environment`), the machine. One call serves both
    keys of a lookup (:func:`pre_key`, :func:`kernel_key`)."""
    import tilelang
    from tilelang.contrib.nvcc import get_nvcc_subprocess_env

    _settle()
    return {
        "tilelang": tilelang.__version__,
        "libraries": library_stamp(),
        "compilers": compilers(backend),
        # Read at each lookup: a process may set NVCC_APPEND_FLAGS between two compiles.
        "environment": nvcc_key.environment(get_nvcc_subprocess_env() or os.environ),
        "machine": platform.machine(),
    }


def _build(
    namespace: str,
    upstream_key: str,
    backend: str,
    target: Any,
    trees: object,
    shared: dict[str, Any],
) -> str:
    """The fields of both keys below; ``trees`` is the header trees' field, their
    contents or their folders (in the same place in both)."""
    builder = (
        KeyBuilder(namespace)
        .add("schema", SCHEMA)
        .add("upstream", upstream_key)
        .add("backend", backend)
        .add("target", str(target))
        .add("headers", trees)
    )
    return with_shared(builder, shared).hexdigest()


def with_shared(builder: KeyBuilder, shared: dict[str, Any]) -> KeyBuilder:
    """``builder`` with every field of :func:`shared_fields`, so that a field added
    there reaches every key built from them (kernels, manifests, binaries)."""
    for label, value in shared.items():
        builder.add(label, value)
    return builder


def kernel_key(
    upstream_key: str, backend: str, target: Any, shared: dict[str, Any] | None = None
) -> str:
    """The kernelcache key of one TileLang kernel (the header trees' contents included);
    ``shared``: :func:`shared_fields` of ``backend``, when the caller has them."""
    _settle()  # a tree a prefetch thread is walking is not walked twice
    fields = shared if shared is not None else shared_fields(backend)
    return _build(NAMESPACE, upstream_key, backend, target, headers(), fields)


def header_folders() -> dict[str, str | None]:
    """The header trees' folders by label, as real paths (``None``: no such folder)."""
    return {label: _real_folder(headers_folder(label)) for label in HEADER_TREES}


def _resolve(folder: str | None) -> str | None:
    """The real path of a header tree's folder; ``None`` when there is no such folder."""
    return _fs.realpath(folder) if folder and os.path.isdir(folder) else None


# Per process, as the trees' fingerprints are (``_tree``): a hit costs no lstat walk.
_real_folder = functools.cache(_resolve)


def pre_key(
    upstream_key: str, backend: str, target: Any, shared: dict[str, Any] | None = None
) -> str:
    """The key of a kernel's header manifest: :func:`kernel_key` without the trees'
    contents, with their folders instead (the manifest names files under them)."""
    fields = shared if shared is not None else shared_fields(backend)
    return _build(MANIFEST_NAMESPACE, upstream_key, backend, target, header_folders(), fields)
