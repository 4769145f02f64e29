"""The key of an NVRTC compile, and this process's memo of the keys it derived.

The key (see :mod:`kernelcache.nvrtc.compiler`) needs the content of every
header the source reaches: finding them (:func:`includes.scan`) and hashing the
key cost tens of microseconds, and a JIT asks for the same kernel again and
again. So a process remembers, per set of arguments, the key it derived and
what vouches for it: the stat signature (:func:`kernelcache._fs.signature`) of
every file the scan read and of every directory that guards a header it did
not find. A later call with the same arguments reuses the key while all of
them are unchanged (a ``stat`` each, nothing read or hashed); any change (an
edit, a file renamed over, a ``touch``, a header created earlier in the
search path) derives the key again from the files' contents. A scan that saw
a file younger than the file system's timestamp granularity
(:func:`kernelcache._fs.too_new`) is never remembered: an edit within the
same tick could leave its signature unchanged.

A scan that is unsure of an include, or that found a time macro without
``KERNELCACHE_SLOPPINESS=time_macros``, gives no key at all: the compile is
not cached and not remembered (:func:`cached_key` returns the reason).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernelcache.keys import KeyBuilder
from kernelcache.nvrtc import includes
from kernelcache.nvrtc.options import Options, canonical_options

TARGETS = ("cubin", "ptx", "ltoir")


@dataclass(frozen=True)
class Request:
    """One compile's inputs, validated and normalised."""

    src: bytes
    name: str
    arch: str
    target: str
    opts: Options
    hdrs: dict[str, bytes]
    dirs: list[str]
    exprs: list[str]


def request(
    source: str | bytes,
    name: str,
    arch: str,
    target: str,
    options: Sequence[str],
    headers: Mapping[str, str | bytes] | None,
    include_dirs: Sequence[str | os.PathLike[str]],
    name_expressions: Sequence[str],
) -> Request:
    """Validate and normalise :func:`kernelcache.nvrtc.compile`'s arguments."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, not {target!r}")
    if not isinstance(arch, str) or not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', not {arch!r}")
    if target == "cubin" and not arch.startswith("sm_"):
        raise ValueError(f"a cubin needs a real architecture (sm_XY), not {arch!r}")
    if isinstance(options, str):
        raise TypeError("options must be a sequence of str, not one str")
    opts = canonical_options(options)
    if target == "ltoir" and "--dlink-time-opt" not in opts.keyed:
        opts.passed.append("-dlto")  # NVRTC only emits LTO-IR with -dlto
        opts.keyed.append("--dlink-time-opt")
    return Request(
        src=source.encode() if isinstance(source, str) else bytes(source),
        name=name,
        arch=arch,
        target=target,
        opts=opts,
        hdrs={
            str(k): (v.encode() if isinstance(v, str) else bytes(v))
            for k, v in (headers or {}).items()
        },
        dirs=[os.fspath(d) for d in include_dirs] + opts.include_dirs,
        exprs=[str(e) for e in name_expressions],
    )


def derive(req: Request) -> tuple[str, includes.Scan]:
    """The key of ``req`` from the files' contents, and the scan that found them."""
    from kernelcache import toolchain

    opts = req.opts
    found = includes.scan(
        req.src,
        source_dir=None if opts.no_source_include else os.path.dirname(req.name),
        include_dirs=req.dirs,
        headers=req.hdrs,
        pre_includes=opts.pre_includes,
        path_sensitive=opts.debug,
    )
    builder = KeyBuilder("kernelcache.nvrtc")
    builder.add("nvrtc", toolchain.nvrtc())
    builder.add("source", req.src).add("name", req.name)
    builder.add("arch", req.arch).add("target", req.target)
    builder.add("options", opts.keyed).add("name_expressions", req.exprs)
    builder.add("headers", req.hdrs).add("included", [list(row) for row in found.rows])
    builder.add("pre_includes", opts.pre_includes)
    # Debug info and __FILE__ name files by the path NVRTC saw.
    builder.add("paths", found.paths + ([os.getcwd()] if opts.debug else []))
    return builder.hexdigest(), found


def refusal(found: includes.Scan) -> str | None:
    """Why a compile with this scan cannot be cached (one rule with the launcher), or ``None``."""
    from kernelcache.sloppiness import time_macros_allowed

    if found.unsure is not None:
        return f"include directives the scanner cannot follow ({found.unsure})"
    if found.time_macro is not None and not time_macros_allowed():
        return (
            f"uses {found.time_macro}, so its binary depends on the clock "
            "(KERNELCACHE_SLOPPINESS=time_macros caches it anyway)"
        )
    return None


class KeyMemo:
    """Keys this process derived, by the exact arguments they were derived from.

    Thread-safe; bounded (the oldest is dropped first). A key is returned
    only while every file and directory its scan depended on keeps the stat
    signature it had (see the module docstring).
    """

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._known: dict[tuple[Any, ...], tuple[str, includes.Scan]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    def lookup(self, args: tuple[Any, ...]) -> str | None:
        known = self._known.get(args)
        if known is None or not includes.still_valid(known[1].checks, known[1].absent):
            return None
        if known[1].time_macro is not None and refusal(known[1]) is not None:
            return None  # remembered under time_macros sloppiness, since withdrawn
        return known[0]

    def remember(self, args: tuple[Any, ...], key: str, scan: includes.Scan) -> None:
        if not scan.memoizable:  # a file too young to vouch for its content
            return
        with self._lock:  # eviction iterates the dict: not atomic across threads
            if len(self._known) >= self.limit:
                self._known.pop(next(iter(self._known)))
            self._known[args] = (key, scan)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()


#: This process's memo (tests replace it with a fresh one).
memo = KeyMemo()


def arguments(
    source: object,
    name: object,
    arch: object,
    target: object,
    options: Sequence[str],
    headers: Mapping[str, str | bytes] | None,
    include_dirs: Sequence[str | os.PathLike[str]],
    name_expressions: Sequence[str],
) -> tuple[Any, ...] | None:
    """The memo's key for these arguments, or ``None`` if they cannot serve as one.

    Every part must be exactly ``str`` or ``bytes``: equal values of other
    types (``1`` and ``True``, a ``str`` subclass with its own ``__eq__``)
    would share a memo entry while giving different keys. The working
    directory is part of it: relative include directories and the source's
    own directory are searched from there.
    """
    if isinstance(options, str):
        return None  # refused by request(), with the reason
    try:
        opts = tuple(options)
        exprs = tuple(name_expressions)
        dirs = tuple([os.fspath(d) for d in include_dirs])
        hdrs = tuple(sorted(headers.items())) if headers else ()
    except TypeError:  # not iterable, no path, or keys that do not sort
        return None
    parts = {type(source), type(name), type(arch), type(target)}
    parts.update(map(type, opts), map(type, exprs), map(type, dirs))
    for pair in hdrs:
        parts.update(map(type, pair))
    if not parts <= {str, bytes}:
        return None
    return (os.getcwd(), source, name, arch, target, opts, hdrs, dirs, exprs)


def cached_key(args: tuple[Any, ...] | None, make: Callable[[], Request]) -> tuple[str, str | None]:
    """``(key, None)`` for ``args`` from :data:`memo` if still valid, else derived and remembered.

    ``(key, reason)`` when the compile cannot be cached (:func:`refusal`):
    then nothing is remembered and the key must not be used.
    """
    if args is not None:
        key = memo.lookup(args)
        if key is not None:
            return key, None
    key, scan = derive(make())
    why = refusal(scan)
    if why is None and args is not None:
        memo.remember(args, key, scan)
    return key, why
