"""Cached NVRTC compiles: ``kernelcache.nvrtc.compile(source, arch="sm_90")``.

The key holds everything that changes the binary and nothing that does not:
NVRTC's version (from the library, plus the library's content hash), the
source and its ``name``, the options in canonical form, arch and target, the
name expressions, every in-memory header, and the *contents* of every header
file the source reaches through ``include_dirs`` or its own directory (found
by scanning ``#include`` directives, see :mod:`kernelcache.nvrtc.includes`: NVRTC 13.5
has no dependency output). Paths appear in the key only where they end up in
the binary (debug info, ``__FILE__``), so a copy of a project hits.

Lowered names of ``name_expressions`` are stored in the entry's metadata, so
they survive a hit (cuda.core's program cache drops them). Failed compiles
raise :class:`NVRTCError` with the log and are not cached. A source whose
includes the scanner cannot follow exactly, or that names a time macro
(without ``KERNELCACHE_SLOPPINESS=time_macros``), is compiled every time,
uncached, and counted as ``uncacheable`` in the cache's compile statistics.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelcache._extras import missing
from kernelcache.errors import KernelCacheError
from kernelcache.nvrtc.key import TARGETS, Request, arguments, cached_key, request
from kernelcache.nvrtc.options import ALIASES, FORBIDDEN, Options, canonical_options

if TYPE_CHECKING:
    from kernelcache.cache import Cache
    from kernelcache.entry import Entry

__all__ = [
    "ALIASES",
    "FORBIDDEN",
    "TARGETS",
    "CompileResult",
    "NVRTCError",
    "Options",
    "cache_key",
    "canonical_options",
    "compile",
]

_ARTIFACT = {"cubin": "kernel.cubin", "ptx": "kernel.ptx", "ltoir": "kernel.ltoir"}


class NVRTCError(KernelCacheError):
    """NVRTC rejected the program; ``log`` holds its diagnostics."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n{log}".rstrip())
        self.log = log


@dataclass(frozen=True)
class CompileResult:
    """A compiled program: ``binary`` (cubin, PTX or LTO-IR bytes) and what NVRTC said.

    ``log`` and ``lowered_names`` come from the entry's JSON metadata, parsed
    when first asked for: a hit that only needs the binary does not pay it.
    """

    binary: bytes
    target: str
    hit: bool
    key: str
    entry: Entry

    @functools.cached_property
    def log(self) -> str:
        """NVRTC's log of the compile (kept with the entry: a hit gives the same)."""
        return str(self.entry.meta.get("log", ""))

    @functools.cached_property
    def lowered_names(self) -> dict[str, str]:
        """Each name expression's lowered (mangled) name."""
        return dict(self.entry.meta.get("lowered_names", {}))

    def path(self) -> str:
        """A real file holding the binary, for loaders that need one."""
        return self.entry.path(_ARTIFACT[self.target])


def cache_key(
    source: str | bytes,
    *,
    name: str = "kernel.cu",
    arch: str = "sm_90",
    target: str = "cubin",
    options: Sequence[str] = (),
    headers: Mapping[str, str | bytes] | None = None,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    name_expressions: Sequence[str] = (),
) -> str:
    """The key :func:`compile` would use for these arguments, without compiling.

    Raises ``ValueError`` for a compile that cannot be cached (it has no key).
    """
    args = arguments(source, name, arch, target, options, headers, include_dirs, name_expressions)
    key, why = cached_key(
        args,
        lambda: request(
            source, name, arch, target, options, headers, include_dirs, name_expressions
        ),
    )
    if why is not None:
        raise ValueError(f"this NVRTC compile cannot be cached: {why}")
    return key


def compile(
    source: str | bytes,
    *,
    name: str = "kernel.cu",
    arch: str = "sm_90",
    target: str = "cubin",
    options: Sequence[str] = (),
    headers: Mapping[str, str | bytes] | None = None,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    name_expressions: Sequence[str] = (),
    cache: Cache | None = None,
) -> CompileResult:
    """Compile ``source`` with NVRTC, or return the cached result of the same compile.

    Raises :class:`NVRTCError` (with NVRTC's log) when the program does not
    compile, and ``ValueError`` for options or includes that cannot be keyed.
    """

    def make() -> Request:
        return request(source, name, arch, target, options, headers, include_dirs, name_expressions)

    # A repeated call reuses its key while no file its scan read has changed (key.py).
    args = arguments(source, name, arch, target, options, headers, include_dirs, name_expressions)
    key, why = cached_key(args, make)
    if cache is None:
        from kernelcache._defaults import default_cache

        cache = default_cache()
    if why is not None:  # compiled as if there were no cache, and counted
        entry = _compile_entry(make())
        cache.count_uncacheable()
        return CompileResult(entry[_ARTIFACT[target]], target, False, key, entry)
    compiled = False

    def run() -> Entry:
        nonlocal compiled
        compiled = True
        return _compile_entry(make())

    entry = cache.get_or_compile(key, run)
    return CompileResult(entry[_ARTIFACT[target]], target, not compiled, key, entry)


def _compile_entry(req: Request) -> Entry:
    try:
        from cuda.bindings import nvrtc as _nvrtc
    except ModuleNotFoundError as exc:
        feature = "kernelcache.nvrtc.compile"
        raise missing(exc, package="cuda.bindings", extra="nvrtc", feature=feature) from exc

    from kernelcache.entry import Entry

    names = [k.encode() for k in req.hdrs]
    err, prog = _nvrtc.nvrtcCreateProgram(
        req.src, req.name.encode(), len(req.hdrs), list(req.hdrs.values()), names
    )
    _check(_nvrtc, err, "nvrtcCreateProgram")
    try:
        for expr in req.exprs:
            added = _nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            _check(_nvrtc, added[0], "nvrtcAddNameExpression")
        # include_dirs= first, then the -I options in their own place.
        own_dirs = req.dirs[: len(req.dirs) - len(req.opts.include_dirs)]
        args = [f"-arch={req.arch}", *(f"-I{d}" for d in own_dirs), *req.opts.passed]
        (err,) = _nvrtc.nvrtcCompileProgram(prog, len(args), [a.encode() for a in args])
        log = _program_log(_nvrtc, prog)
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NVRTCError(f"NVRTC failed to compile {req.name!r} ({_result_name(err)})", log)
        binary = _binary(_nvrtc, prog, req.target)
        lowered = {}
        for expr in req.exprs:
            err, raw = _nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(_nvrtc, err, "nvrtcGetLoweredName")
            lowered[expr] = raw.decode() if isinstance(raw, bytes) else str(raw)
    finally:
        _nvrtc.nvrtcDestroyProgram(prog)
    meta: dict[str, Any] = {"compiler": "nvrtc", "name": req.name, "arch": req.arch}
    meta.update(target=req.target, log=log, lowered_names=lowered)
    return Entry({_ARTIFACT[req.target]: binary}, meta)


def _result_name(err: Any) -> str:
    return str(getattr(err, "name", err))


def _check(module: Any, err: Any, call: str) -> None:
    if err != module.nvrtcResult.NVRTC_SUCCESS:
        raise NVRTCError(f"{call} failed ({_result_name(err)})")


def _program_log(module: Any, prog: Any) -> str:
    err, size = module.nvrtcGetProgramLogSize(prog)
    _check(module, err, "nvrtcGetProgramLogSize")
    buf = bytearray(size)
    _check(module, module.nvrtcGetProgramLog(prog, buf)[0], "nvrtcGetProgramLog")
    return bytes(buf).rstrip(b"\0").decode("utf-8", "replace")


def _binary(module: Any, prog: Any, target: str) -> bytes:
    size_fn, get_fn = {
        "cubin": (module.nvrtcGetCUBINSize, module.nvrtcGetCUBIN),
        "ptx": (module.nvrtcGetPTXSize, module.nvrtcGetPTX),
        "ltoir": (module.nvrtcGetLTOIRSize, module.nvrtcGetLTOIR),
    }[target]
    err, size = size_fn(prog)
    _check(module, err, size_fn.__name__)
    buf = bytearray(size)
    _check(module, get_fn(prog, buf)[0], get_fn.__name__)
    data = bytes(buf)
    # PTX comes NUL-terminated; the file form (and cuda.core's) has no NUL.
    return data.rstrip(b"\0") if target == "ptx" else data
