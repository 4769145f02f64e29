"""Which headers a CUDA source includes, found by scanning ``#include`` directives.

NVRTC 13.5 has no dependency output (``-M``, ``-MD`` and ``--dependency-output``
are rejected as unrecognised options), so the NVRTC key scans the source and
every header it reaches, transitively, with the search rules NVRTC follows:

- a quoted include is looked up in the including file's directory (for the
  main source: the directory of its ``name``, i.e. the working directory for
  a bare name, unless ``--no-source-include``), then in the ``-I`` directories;
- an angle include is looked up in the ``-I`` directories only;
- in-memory headers (``headers=``) match by include name.

The scan over-approximates and never under-approximates: every existing
candidate for an include is hashed, not only the first (so a slip in modelling
NVRTC's search order costs a spurious miss, never a stale hit); includes in
inactive ``#if`` branches and comments count; ``__has_include`` names count.
Directives are read by :mod:`kernelcache.directives` (splices, digraphs,
comments inside directives); what it cannot read exactly (``#include MACRO``,
``__has_include(MACRO)``, ...) sets :attr:`Scan.unsure`, and so does a time
macro (:attr:`Scan.time_macro`): the caller then does not cache (issue 19).
A ``..`` is resolved as the compiler resolves it, through symlinks (the real
path of the including file's directory), not on paper.

Files are identified in keys by *logical location* (search root label and the
path below it), never by absolute path, so a copy of a project in another
directory gives the same key.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kernelcache import _fs, directives

Signature = tuple[int, int, int, int, int]  # _fs.signature

#: Markers of path-dependent output: the file's path as NVRTC spells it ends up
#: in the binary, so it must be in the key.
_PATH_MACROS = (b"__FILE__", b"__FILE_NAME__")
_MEMO_LIMIT = 4096


@dataclass(frozen=True)
class Parsed:
    """What one file contributes: its digest and the includes it names."""

    digest: bytes
    includes: tuple[tuple[str, str], ...]  # (delimiter, spelling)
    unsure: str | None  # what the directive reader did not understand
    time_macro: str | None  # the first time macro named
    path_sensitive: bool


def parse(content: bytes) -> Parsed:
    found = directives.scan(content)
    includes = [('"' if quoted else "<", name) for quoted, _next, name in found.includes]
    return Parsed(
        digest=hashlib.sha256(content).digest(),
        includes=tuple(dict.fromkeys(includes)),
        unsure=found.unsure,
        time_macro=directives.time_macro(content),
        path_sensitive=any(marker in content for marker in _PATH_MACROS),
    )


_signature = _fs.signature


def fresh(st: os.stat_result) -> bool:
    """Whether a file changed too recently for its stat to vouch for its content."""
    return _fs.too_new(st, time.time_ns())


# Parsed files memoised by absolute path and stat signature (this process only).
_parsed: dict[str, tuple[Signature, Parsed]] = {}
_parsed_lock = threading.Lock()


def parse_file(path: str) -> tuple[Parsed, Signature, bool]:
    """Parse ``path``; returns the result, its stat signature and whether it was too fresh."""
    st = os.stat(path)
    sig = _signature(st)
    absolute = os.path.abspath(path)
    known = _parsed.get(absolute)
    if known is not None and known[0] == sig:
        return known[1], sig, False
    with open(path, "rb") as f:
        parsed = parse(f.read())
    too_fresh = fresh(st)
    if not too_fresh:
        with _parsed_lock:  # eviction iterates the dict: not atomic across threads
            if len(_parsed) >= _MEMO_LIMIT:
                _parsed.pop(next(iter(_parsed)))
            _parsed[absolute] = (sig, parsed)
    return parsed, sig, too_fresh


@dataclass
class Scan:
    """The result of scanning one compile's include graph.

    ``rows`` go into the key; ``checks`` (scanned files) and ``absent`` (the
    nearest existing directory of each candidate that did not exist) let a
    caller revalidate the scan later with ``stat`` calls only (see
    :func:`still_valid`). Creating a file changes its directory's mtime, so
    one directory ``stat`` covers every missing candidate in it.
    """

    rows: list[tuple[str, str, bytes]] = field(default_factory=list)  # (root, path, digest)
    paths: list[str] = field(default_factory=list)  # as NVRTC spells them, for path-sensitive keys
    checks: list[tuple[str, Signature]] = field(default_factory=list)
    absent: dict[str, Signature] = field(default_factory=dict)
    memoizable: bool = True
    unsure: str | None = None  # set: the key may miss a header, so nothing is cached
    time_macro: str | None = None  # set: the binary depends on the clock


def scan(
    source: bytes,
    *,
    source_dir: str | None,
    include_dirs: Sequence[str],
    headers: Mapping[str, bytes],
    pre_includes: Sequence[str] = (),
    path_sensitive: bool = False,
) -> Scan:
    """Scan ``source`` and everything it reaches; see the module docstring.

    ``source_dir`` is the directory NVRTC searches for the main source's
    quoted includes (``""`` for the working directory, ``None`` when
    ``--no-source-include`` is given). With ``path_sensitive`` every file's
    spelled path goes into the key (debug info names them).
    """
    roots: dict[str, str] = {f"I{i}": d for i, d in enumerate(include_dirs)}
    if source_dir is not None:
        roots["src"] = source_dir
    result = Scan()
    seen: set[tuple[str, str]] = set()
    # Work items: (parsed file, its root label or None for in-memory, its path below the root).
    work: list[tuple[Parsed, str | None, str, str]] = [
        (parse(source), "src" if source_dir is not None else None, "", "<source>")
    ]
    for name in pre_includes:
        found = len(result.rows)
        main_root = "src" if source_dir is not None else None
        _resolve(('"', name), main_root, "", roots, headers, work, seen, result, path_sensitive)
        if name not in headers and len(result.rows) == found:
            raise ValueError(
                f"pre-included header {name!r} is neither in headers= nor in include_dirs, "
                "so its content cannot be part of the key; pass it in headers="
            )
    while work:
        parsed, root, rel, where = work.pop()
        if parsed.unsure is not None and result.unsure is None:
            result.unsure = f"{where}: {parsed.unsure}"
        if parsed.time_macro is not None and result.time_macro is None:
            result.time_macro = f"{parsed.time_macro} in {where}"
        for include in parsed.includes:
            _resolve(include, root, rel, roots, headers, work, seen, result, path_sensitive)
    result.rows.sort()
    return result


def _resolve(
    include: tuple[str, str],
    root: str | None,
    rel: str,
    roots: Mapping[str, str],
    headers: Mapping[str, bytes],
    work: list[tuple[Parsed, str | None, str, str]],
    seen: set[tuple[str, str]],
    result: Scan,
    path_sensitive: bool,
) -> None:
    delimiter, spelling = include
    if spelling in headers and ("mem", spelling) not in seen:
        seen.add(("mem", spelling))
        # NVRTC looks up an in-memory header's quoted includes next to its
        # name, relative to the working directory (checked with NVRTC 13.5).
        work.append((parse(headers[spelling]), "cwd", spelling, spelling))
    candidates: list[tuple[str, str]] = []
    if delimiter == '"' and root is not None:
        base = "" if root == "cwd" else roots[root]
        candidates.append((root, _below(base, os.path.join(os.path.dirname(rel), spelling))))
    candidates += [
        (label, _below(roots[label], spelling)) for label in roots if label.startswith("I")
    ]
    for label, below in candidates:
        if (label, below) in seen:
            continue
        seen.add((label, below))
        base = "" if label == "cwd" else roots[label]
        path = os.path.join(base, below) if base else below
        try:
            parsed, sig, too_fresh = parse_file(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            _guard_absent(os.path.abspath(path), result)
            continue
        result.rows.append((label, below.replace(os.sep, "/"), parsed.digest))
        result.checks.append((os.path.abspath(path), sig))
        result.memoizable = result.memoizable and not too_fresh
        if path_sensitive or parsed.path_sensitive:
            result.paths.append(path)
        work.append((parsed, label, below, path))


def _below(base: str, spelled: str) -> str:
    """Where ``spelled`` (relative to ``base``) is, as the compiler finds it.

    ``os.path.normpath`` drops ``x/..`` on paper; the compiler's ``open``
    goes through ``x`` first, and when ``x`` is a symlink lands elsewhere
    (issue 19). A path with ``..`` is resolved physically (the real path of
    its directory), relative to the real ``base`` where it stays below it,
    else absolute (it names a file outside the search root).
    """
    if ".." not in spelled.replace(os.sep, "/").split("/"):
        return os.path.normpath(spelled)
    real_base = _fs.realpath(base or os.curdir)
    head, name = os.path.split(os.path.join(base, spelled) if base else spelled)
    real = os.path.join(_fs.realpath(head or os.curdir), name)
    if real.startswith(real_base + os.sep):
        return os.path.relpath(real, real_base)
    return real


def _guard_absent(path: str, result: Scan) -> None:
    """Record the nearest existing directory above a missing candidate."""
    folder = os.path.dirname(path)
    while True:
        try:
            st = os.stat(folder)
            break
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(folder)
            if parent == folder:
                return
            folder = parent
    if folder not in result.absent:
        result.absent[folder] = _signature(st)
        result.memoizable = result.memoizable and not fresh(st)


def still_valid(
    checks: Sequence[tuple[str, Signature]],
    absent: Mapping[str, Signature],
) -> bool:
    """Whether no scanned file changed and no directory guarding a missing candidate did."""
    for path, sig in [*checks, *absent.items()]:
        try:
            if _signature(os.stat(path)) != sig:
                return False
        except OSError:
            return False
    return True
