"""What a compile's sources say beyond their dependency list: failed lookups and time macros.

*Failed include lookups.* With ``-Ia -Ib`` and ``inc.h`` only in ``b/``, the
preprocessor looked for ``a/inc.h`` first and did not find it; creating
``a/inc.h`` later changes the compile although no dependency changed (ccache
has this bug). After a miss, every ``#include``, ``#include_next`` and
``__has_include`` of every dependency is resolved along the user's search
path (the including file's directory for quoted names, then ``-I``,
``CPATH``, ``-isystem``, as gcc does) and the candidates before the one that
exists are recorded as *absent*. A lookup re-checks them: one ``stat`` per
directory that holds candidates while that directory is unchanged, and a
``stat`` per candidate once it changed. Directories nvcc and gcc add
themselves (the toolkit's and the system's) are not watched: a header
appearing there is a toolchain change. The directives are read by
:mod:`kernelcache.directives`; a dependency it cannot read exactly (a
computed ``#include MACRO``, ``__has_include(MACRO)``, ...) raises
:class:`Unsure`, and the result is then found by its preprocessed key only,
never through the manifest (issue 19).

*Time macros.* A dependency that mentions ``__TIME__``, ``__DATE__`` or
``__TIMESTAMP__`` makes the result depend on the clock: it is not cached
unless ``KERNELCACHE_SLOPPINESS=time_macros`` (ccache's switch) says so, the
rule of every integration (:func:`kernelcache.directives.time_macro`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kernelcache import _fs
from kernelcache.nvcc.args import normalize_path
from kernelcache.nvcc.deps import resolve, signature

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from kernelcache.directives import Directives
    from kernelcache.nvcc.args import Invocation


class Unsure(Exception):
    """A dependency names headers in a way the scanner cannot follow exactly (the reason)."""


#: What this process read in each file's content: its directives and time macro, by the
#: bytes themselves (a pure function of them). The server stores compile after compile
#: of the same headers (a CUDA source reaches ~190), so each is scanned once.
_SCANS: dict[bytes, tuple[Directives, str | None]] = {}
_SCANS_MAX_BYTES = 64 << 20
_scanned_bytes = 0


def _scan(data: bytes) -> tuple[Directives, str | None]:
    global _scanned_bytes
    found = _SCANS.get(data)
    if found is None:
        from kernelcache import directives  # a miss only: a hit compiles none of its patterns

        found = directives.scan(data), directives.time_macro(data)
        if _scanned_bytes + len(data) > _SCANS_MAX_BYTES:
            _SCANS.clear()
            _scanned_bytes = 0
        _SCANS[data] = found
        _scanned_bytes += len(data)
    return found


def time_macro(contents: Mapping[str, bytes]) -> str | None:
    """``"__TIME__ in k.cu"`` for the first file that mentions a time macro, else ``None``."""
    for path, data in contents.items():
        macro = _scan(data)[1]
        if macro is not None:
            return f"{macro} in {path}"
    return None


def search_path(inv: Invocation, env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """``(-I dirs then CPATH, -isystem dirs)`` of this call, in gcc's order."""
    include = [d for kind, d in inv.includes if kind == "include"]
    include += [d or "." for d in env.get("CPATH", "").split(os.pathsep) if env.get("CPATH")]
    system = [d for kind, d in inv.includes if kind == "isystem"]
    return include, system


def _directives(path: str, data: bytes) -> tuple[tuple[bool, bool, str], ...]:
    """``(quoted, next, name)`` of every include-like directive in a file; :class:`Unsure` if unclear."""
    found = _scan(data)[0]
    if found.unsure is not None:
        raise Unsure(f"{path}: {found.unsure}")
    return found.includes


def absent(
    contents: Mapping[str, bytes], user_dirs: Sequence[str], started_ns: int
) -> list[str] | None:
    """Paths the preprocessor looked for and did not find (see the module docstring).

    ``None`` when a candidate appeared during the compile (the result is then
    not cached: the compile may or may not have seen it). Raises
    :class:`Unsure` when a dependency's directives cannot be read exactly.
    """
    deps = {os.path.normpath(p) for p in contents}
    dirs = [os.path.normpath(d) for d in user_dirs]
    out: dict[str, None] = {}
    for path, data in contents.items():
        here = os.path.normpath(os.path.dirname(path) or ".")
        found_in = next((i for i, d in enumerate(dirs) if here == d), None)
        for quoted, nxt, name in _directives(path, data):
            if os.path.isabs(name):
                continue
            if nxt:
                chain = dirs[found_in + 1 :] if found_in is not None else []
            else:
                chain = ([here] if quoted else []) + dirs
            for d in chain:
                candidate = _physical(os.path.join(d, name))
                try:
                    st = os.stat(candidate)
                except OSError:
                    out[candidate] = None
                    continue
                if candidate not in deps and max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns:
                    return None  # appeared during the compile: which one did it see?
                break  # found here: later directories were not searched
    return list(out)


def _physical(path: str) -> str:
    """``path`` as ``open`` finds it: a ``..`` after a symlink goes up from its target."""
    if ".." not in path.split(os.sep):
        return os.path.normpath(path)
    head, name = os.path.split(path)
    return os.path.join(_fs.realpath(head or os.curdir), name)


def watch(paths: Sequence[str], basedir: str | None) -> list[list[Any]]:
    """Absent paths grouped under the nearest existing directory, with its stat signature.

    A directory whose signature is unchanged cannot have gained an entry; one
    changed too recently to trust (timestamps are coarse) has no signature.
    """
    groups: dict[str, list[str]] = {}
    nearest: dict[str, str] = {}  # a CUDA source's ~1000 candidates share a few directories
    for path in paths:
        where = os.path.dirname(path) or "."
        parent = nearest.get(where)
        if parent is None:
            parent = where
            while not os.path.isdir(parent) and parent not in ("", os.sep, "."):
                parent = os.path.dirname(parent) or "."
            nearest[where] = parent
        prefix = parent.rstrip(os.sep) + os.sep
        if path.startswith(prefix) and parent != "." and _normal(path):
            name = path[len(prefix) :]  # relpath's answer, without its two abspath calls
        else:
            name = os.path.relpath(path, parent)
        groups.setdefault(parent, []).append(name)
    now = time.time_ns()
    out = []
    for parent, names in groups.items():
        try:
            st = os.stat(parent)
        except OSError:
            sig = None
        else:
            sig = None if _fs.too_new(st, now) else signature(st)
        out.append([normalize_path(parent, basedir), sig, names])
    return out


def _normal(path: str) -> bool:
    """Whether ``normpath`` would leave ``path`` as it is (no ``.``, ``..``, ``//`` or a
    trailing ``/``); ``False`` for some that it would (a name starting with a dot),
    which costs only time."""
    return not (
        path.startswith(".") or path.endswith(os.sep) or os.sep + "." in path or os.sep * 2 in path
    )


def still_absent(groups: Sequence[Sequence[Any]], basedir: str | None) -> bool:
    """Whether every recorded absent path is still absent."""
    for stored, sig, names in groups:
        parent = resolve(stored, basedir)
        if parent is None:
            return False
        if sig is not None:
            try:
                if signature(os.stat(parent)) == sig:
                    continue
            except OSError:
                pass  # the directory went away: its candidates are checked one by one
        for name in names:
            if os.path.lexists(os.path.join(parent, name)):
                return False
    return True
