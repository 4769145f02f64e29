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

Recording them (the compile's nvcc call, its preprocessor runs, the
manifest's write) is :mod:`kernelcache.tilelang.recording`; this module
looks manifests up.

Only the ``tvm_ffi`` backend is served this way: its one nvcc run is the
device compile captured here (its host side is LLVM's, linked without
headers). The cython backend compiles a wrapper with the same ``-I`` folders
in a second run, and the nvrtc backend compiles in-process with NVRTC, whose
include lookups nvcc cannot report: both keep the walk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any

from kernelcache import _fs
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.integration import Counters
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


def _roots() -> list[str]:
    return [folder for folder in keys.header_folders().values() if folder]


class _Roots:
    """The header trees' folders (real paths), for the path tests of a lookup (~140 a hit).

    Recorded paths are real paths (:func:`kernelcache.tilelang.recording.record`): no ``.``, ``..`` or ``//``
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
    resolve = _Resolver()
    for path in read:
        real = resolve(path)
        if trees.holds(real):
            out.append(real)
        elif trees.holds(os.path.normpath(os.path.abspath(path))):
            return None
    return out


class _Resolver:
    """``os.path.realpath`` of many files in few directories: each directory resolved once.

    nvcc's ``-M`` lists ~300 files (the CUDA and system headers too) in a few
    dozen directories; a ``realpath`` each (an ``lstat`` per path component)
    cost ~23 ms of a manifest's recording, on the compiling process's way out.
    A file that is itself a link is resolved whole.
    """

    def __init__(self) -> None:
        self.folders: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        folder, name = os.path.split(path)
        if name in ("", ".", "..") or not folder:
            return _fs.realpath(path)
        real_folder = self.folders.get(folder)
        if real_folder is None:
            real_folder = self.folders[folder] = _fs.realpath(folder)
        candidate = os.path.join(real_folder, name)
        return _fs.realpath(candidate) if os.path.islink(candidate) else candidate


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
    """Whether a variant has the shape :func:`~kernelcache.tilelang.recording.record` writes, every path under the trees."""
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
            if deps.unchanged(stat(folder), sig):
                continue
            if _names(folder) != names:
                return False
        except OSError:
            return False
    return True
