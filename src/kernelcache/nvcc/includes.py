"""What a compile's sources say beyond their dependency list: failed lookups and time macros.

*Failed include lookups.* With ``-Ia -Ib`` and ``inc.h`` only in ``b/``, the
preprocessor looked for ``a/inc.h`` first and did not find it; creating
``a/inc.h`` later changes the compile although no dependency changed (ccache
has this bug). After a miss, every ``#include``, ``#include_next`` and
``__has_include`` of every dependency, and every pre-included header
(``-include``, ``-imacros``, ``--pre-include``, nvcc's own ``cuda_runtime.h``),
is looked up in every folder the compiler may search for it (the including
file's folder and ``-iquote`` for quoted names, the working directory for
pre-includes, ``-I``, ``CPATH``, ``-isystem``, ``-idirafter``), and the
candidates that do not exist are recorded as *absent* (:func:`absent`). A
lookup re-checks them: one ``stat`` per directory that holds candidates while
that directory is unchanged, and a ``stat`` per candidate once it changed.
Directories nvcc and gcc add themselves (the toolkit's and the system's) are
not watched: a header appearing there is a toolchain change. The directives
are read by :mod:`kernelcache.directives`; a dependency it cannot read exactly
(a computed ``#include MACRO``, ``__has_include(MACRO)``, ...) or a search
option the scanner does not model (``-iwithprefix``, a sysroot-relative
folder, ``INCLUDES`` for ``nvcc.profile``) raises :class:`Unsure`, and the
result is then found by its preprocessed key only, never through the
manifest (issues 19, 40).

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


#: nvcc pre-includes this header in every CUDA compile (``-include "cuda_runtime.h"``
#: in its ``--dryrun``, 13.0), looked up as any ``-include`` is.
NVCC_PRE_INCLUDE = "cuda_runtime.h"
#: Variables of ``nvcc.profile`` that put search folders where the scanner does not see them.
_PROFILE_SEARCH = ("INCLUDES", "SYSTEM_INCLUDES")


class SearchPath:
    """Where a compile's preprocessor looks for headers, as sets of folders.

    ``quote`` holds the folders only ``#include "..."`` searches (``-iquote``),
    ``both`` those every lookup searches (``-I``, ``CPATH``, ``-isystem``,
    ``-idirafter``, ``C(PLUS)_INCLUDE_PATH``), ``pre`` the headers named by
    ``-include``/``-imacros``/``--pre-include``; ``unsure`` says why the
    lookups cannot be modelled (:class:`Unsure` at the scan).
    """

    __slots__ = ("both", "pre", "quote", "unsure")

    def __init__(
        self, quote: list[str], both: list[str], pre: list[str], unsure: str | None
    ) -> None:
        self.quote, self.both, self.pre, self.unsure = quote, both, pre, unsure


def search_path(inv: Invocation, env: Mapping[str, str]) -> SearchPath:
    """The folders and pre-included headers of this nvcc call (see :class:`SearchPath`)."""
    found = host_search_path(inv.includes, env)
    found.pre.insert(0, NVCC_PRE_INCLUDE)
    for name in _PROFILE_SEARCH:
        if _names_folders(env.get(name, "")):
            found.unsure = found.unsure or (
                f"{name} names search folders or headers (nvcc.profile adds them)"
            )
    return found


#: The variables that add folders to the host compiler's search path, after ``-I``'s.
PATH_VARS = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")


def host_search_path(
    includes: Sequence[tuple[str, str]], env: Mapping[str, str], *, absolute: bool = False
) -> SearchPath:
    """The :class:`SearchPath` of a host compiler's search options (``Invocation.includes``)
    and its environment. ``absolute``: a relative folder is unsure (it is looked up from
    a working directory no key holds); an empty element of a variable means ``.``."""
    quote: list[str] = []
    both: list[str] = []
    pre: list[str] = []
    unsure = None
    for kind, value in includes:
        if kind == "pre":
            pre.append(value)
        elif kind == "unsure":
            unsure = unsure or f"a host search option the scanner does not model ({value})"
        elif value.startswith(("=", "$SYSROOT")):
            unsure = unsure or f"a search folder relative to the sysroot ({value})"
        elif absolute and not os.path.isabs(value):
            unsure = unsure or f"a search folder that is not absolute ({value!r})"
        else:
            (quote if kind == "quote" else both).append(value)
    for name in PATH_VARS:
        if env.get(name):
            for folder in [d or "." for d in env[name].split(os.pathsep)]:
                if absolute and not os.path.isabs(folder):
                    unsure = unsure or f"{name} names a folder that is not absolute ({folder!r})"
                both.append(folder)
    return SearchPath(quote, both, pre, unsure)


def _names_folders(value: str) -> bool:
    """Whether a profile variable's value may add search folders or pre-includes: any
    option but a ``-D``/``-U`` (``-DEXTRA=1`` changes no lookup). Unreadable: it may."""
    import shlex

    try:
        words = shlex.split(value)
    except ValueError:
        return True
    return any(not word.startswith(("-D", "-U")) for word in words)


def _directives(path: str, data: bytes) -> tuple[tuple[bool, bool, str], ...]:
    """``(quoted, next, name)`` of every include-like directive in a file; :class:`Unsure` if unclear."""
    found = _scan(data)[0]
    if found.unsure is not None:
        raise Unsure(f"{path}: {found.unsure}")
    return found.includes


def absent(contents: Mapping[str, bytes], search: SearchPath, started_ns: int) -> list[str] | None:
    """Paths the preprocessor may have looked for and did not find (see the module docstring).

    Every folder a lookup may search is tried, not only those before the one
    that holds the header: gcc's order (``-iquote`` first, host options before
    nvcc's, ``-isystem`` after ``-I``, ``-idirafter`` last, duplicates and
    system folders dropped from ``-I``, ``#include_next`` starting after the
    includer's folder, ``-include`` from the working directory) then needs no
    modelling, and a header created anywhere along it is a miss (issue 40).
    Creating one after the header found costs a needless compile, never a
    stale hit. ``None`` when a candidate appeared during the compile (the
    result is then not cached: the compile may or may not have seen it).
    Raises :class:`Unsure` when the search or a dependency's directives cannot
    be read exactly.
    """
    if search.unsure is not None:
        raise Unsure(search.unsure)
    deps = {os.path.normpath(p) for p in contents}
    angled = list(dict.fromkeys(os.path.normpath(d) for d in search.both))
    quoted = list(dict.fromkeys([*(os.path.normpath(d) for d in search.quote), *angled]))
    out: dict[str, None] = {}
    seen: set[str] = set()

    def look(chain: Sequence[str], name: str) -> bool:
        if os.path.isabs(name):
            return True  # an absolute name is found or not: a dependency either way
        for d in chain:
            candidate = _physical(os.path.join(d, name))
            if candidate in seen:
                continue
            seen.add(candidate)
            try:
                st = os.stat(candidate)
            except OSError:
                out[candidate] = None
                continue
            if candidate not in deps and max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns:
                return False  # appeared during the compile: did it see it?
        return True

    # -include and -imacros: the working directory, then the quoted chain (gcc's cpp docs).
    for name in search.pre:
        if not look([".", *quoted], name):
            return None
    for path, data in contents.items():
        here = os.path.normpath(os.path.dirname(path) or ".")
        for is_quoted, _next, name in _directives(path, data):
            # #include_next searches on from the includer's folder, and is an #include in
            # the main source: every folder of the chain covers both.
            if not look([here, *quoted] if is_quoted else angled, name):
                return None
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
