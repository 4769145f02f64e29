"""Fingerprints of the header trees nvcc is pointed at, memoised across processes.

TileLang gives nvcc ``-I`` its template folder and CUTLASS's include folder:
~1,200 files, ~33 MB. Hashing them costs ~60 ms of CPU; one ``scandir`` walk
with a ``stat`` per file costs ~8 ms. So a tree's content fingerprint is
memoised in ``<cache dir>/tilelang-header-trees.json`` under a digest of its
files' stat signatures, as the toolchain probes are (``kernelcache._memos``:
read only from a trusted directory, never written read-only), and a file
changed within the timestamp granularity keeps its tree out of the memo
(``_fs.too_new``, ccache's rule). Per process, a tree is fingerprinted once.
"""

from __future__ import annotations

import hashlib
import os
import time

from kernelcache import _fs, _memos, fingerprint

#: The memo file under the cache directory.
TREE_MEMO = "tilelang-header-trees.json"
_MEMO_VERSION = 2  # 2: {"version", "trees": {folder: {"sig", "digest"}}}


def listing(folder: str) -> tuple[list[str], str, bool]:
    """Files under ``folder`` (sorted), a digest of their stat signatures, and whether all are
    old enough to vouch for their content. Links to folders are not followed (as ``os.walk``)."""
    found: list[tuple[str, os.stat_result]] = []
    pending = [folder]
    while pending:
        with os.scandir(pending.pop()) as items:
            for item in items:
                if item.is_dir():
                    if not item.is_symlink():
                        pending.append(item.path)
                    continue
                try:
                    found.append((item.path, item.stat()))
                except FileNotFoundError:
                    continue  # a dangling link: nvcc cannot read it either
    found.sort(key=lambda row: row[0])
    # A memo lookup, not a cache key: paths and stats are what must match here.
    rows = "".join(f"{path}\0{_fs.signature(st)}\n" for path, st in found)
    newest = max((max(st.st_mtime_ns, st.st_ctime_ns) for _, st in found), default=0)
    trusted = time.time_ns() - newest >= _fs.TOO_NEW_NS  # _fs.too_new, for the newest file
    return [path for path, _ in found], hashlib.sha256(rows.encode()).hexdigest(), trusted


def tree_fingerprint(folder: str) -> str:
    """Fingerprint of every file under ``folder`` by relative name and content
    (``fingerprint.files``), from the memo while every file's stat is unchanged.

    Of processes missing the memo at once, one hashes and the others wait for
    its memo (``_memos.exclusive``). Not memoised in process here:
    :func:`kernelcache.tilelang.keys.headers` is.
    """
    paths, signature, trusted = listing(folder)
    known = _known(_memos.load(TREE_MEMO), folder, signature)
    if known is not None:
        return known
    with _memos.exclusive(TREE_MEMO):
        memo = _memos.load(TREE_MEMO)
        known = _known(memo, folder, signature)
        if known is not None:
            return known  # another process hashed it while we waited
        digest = fingerprint.files(paths, root=folder)
        HASHED.append(folder)
        if trusted:
            if memo.get("version") != _MEMO_VERSION:
                memo = {"version": _MEMO_VERSION}
            trees = memo.get("trees")
            memo["trees"] = {
                **(trees if isinstance(trees, dict) else {}),
                folder: {"sig": signature, "digest": digest},
            }
            _memos.save(TREE_MEMO, memo)
    return digest


def memoised(folder: str) -> bool:
    """Whether the memo holds a fingerprint of ``folder`` (of some state of it: unchecked)."""
    memo = _memos.load(TREE_MEMO)
    found = memo.get("trees") if memo.get("version") == _MEMO_VERSION else None
    return isinstance(found, dict) and folder in found


#: Folders this process hashed (not found in the memo), for tests and benchmarks.
HASHED: list[str] = []


def _known(memo: dict[str, object], folder: str, signature: str) -> str | None:
    if memo.get("version") != _MEMO_VERSION:
        return None
    trees = memo.get("trees")
    known = trees.get(folder) if isinstance(trees, dict) else None
    if isinstance(known, dict) and known.get("sig") == signature:
        return str(known["digest"])
    return None
