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
and NVRTC's for the nvrtc backend. No field holds an absolute path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import platform
import shutil
import time
from typing import Any

from kernelcache import _fs, fingerprint, toolchain
from kernelcache.keys import KeyBuilder

NAMESPACE = "kernelcache.tilelang"
SCHEMA = 1

# The native libraries whose content decides code generation (TileLang's own stamp list).
_LIBRARIES = ("libtilelang.so", "libtvm_runtime.so", "libtvm_compiler.so", "libtvm_ffi.so")


def _env_module() -> Any:
    # ``import tilelang.env`` gives the Environment object that tilelang/__init__
    # exports under the same name, not the module that holds TL_LIBS.
    return importlib.import_module("tilelang.env")


def library_stamp() -> dict[str, str]:
    """Content digests of TileLang's native libraries, by file name (memoised by stat)."""
    tl_env = _env_module()
    stamp: dict[str, str] = {}
    for folder in tl_env.TL_LIBS:
        for name in _LIBRARIES:
            path = os.path.join(folder, name)
            if name not in stamp and os.path.isfile(path):
                stamp[name] = toolchain.file_digest(path)
    return stamp


#: Memo of header-tree fingerprints under the cache directory, keyed by folder.
TREE_MEMO = "tilelang-header-trees.json"


def _listing(folder: str) -> tuple[list[str], str, bool]:
    """Files under ``folder``, a digest of their stat signatures, and whether all are old enough.

    Stat-only: ~1,200 ``stat`` calls cost a few ms, hashing the 33 MB ~80 ms.
    """
    paths: list[str] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        paths.extend(os.path.join(root, name) for name in sorted(files))
    rows = []
    now, trusted = time.time_ns(), True
    for path in paths:
        st = os.stat(path)
        rows.append([path, *_fs.signature(st)])
        trusted = trusted and not _fs.too_new(st, now)
    # A memo lookup, not a cache key: a plain digest of the listing will do.
    signature = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    return paths, signature, trusted


def tree_fingerprint(folder: str) -> str:
    """Fingerprint of every file under ``folder`` by relative name and content.

    Memoised per process, and across processes by the files' stat signatures
    (a file changed within the timestamp granularity is never trusted, as
    ccache does), so a hit does not re-read TileLang's ~33 MB of headers.
    """
    paths, signature, trusted = _listing(folder)
    memo_path = os.path.join(os.path.dirname(toolchain.memo_path()), TREE_MEMO)
    try:
        with open(memo_path, "rb") as f:
            memo = json.loads(f.read())
    except (OSError, ValueError):
        memo = {}  # missing or damaged: it is only a memo
    if not isinstance(memo, dict):
        memo = {}
    known = memo.get(folder)
    if isinstance(known, dict) and known.get("sig") == signature:
        return str(known["digest"])
    digest = fingerprint.files(paths, root=folder)
    if trusted:
        memo[folder] = {"sig": signature, "digest": digest}
        try:
            os.makedirs(os.path.dirname(memo_path), mode=0o700, exist_ok=True)
            _fs.write_atomic(memo_path, json.dumps(memo).encode())
        except OSError:
            pass  # only a memo: the next process hashes again
    return digest


#: The header trees nvcc gets as ``-I``, by label: attributes of ``tilelang.env.env``.
HEADER_TREES = {"templates": "TILELANG_TEMPLATE_PATH", "cutlass": "CUTLASS_INCLUDE_DIR"}


_tree = functools.cache(tree_fingerprint)


def headers_folder(label: str) -> str | None:
    """The folder of header tree ``label`` (``TL_TEMPLATE_PATH`` / ``TL_CUTLASS_PATH`` win)."""
    folder = getattr(_env_module().env, HEADER_TREES[label])
    return str(folder) if folder else None


def headers() -> dict[str, str | None]:
    """Fingerprints of the header trees nvcc gets as ``-I`` (templates, CUTLASS)."""
    out: dict[str, str | None] = {}
    for label in HEADER_TREES:
        folder = headers_folder(label)
        out[label] = _tree(os.path.realpath(folder)) if folder and os.path.isdir(folder) else None
    return out


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


def kernel_key(upstream_key: str, backend: str, target: Any) -> str:
    """The kernelcache key of one TileLang kernel."""
    import tilelang

    return (
        KeyBuilder(NAMESPACE)
        .add("schema", SCHEMA)
        .add("upstream", upstream_key)
        .add("backend", backend)
        .add("target", str(target))
        .add("tilelang", tilelang.__version__)
        .add("libraries", library_stamp())
        .add("headers", headers())
        .add("compilers", compilers(backend))
        .add("machine", platform.machine())
        .hexdigest()
    )
