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
raise :class:`NVRTCError` with the log and are not cached.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelcache._extras import missing
from kernelcache.errors import KernelCacheError
from kernelcache.keys import KeyBuilder
from kernelcache.nvrtc import includes

if TYPE_CHECKING:
    from kernelcache.cache import Cache
    from kernelcache.entry import Entry

TARGETS = ("cubin", "ptx", "ltoir")
_ARTIFACT = {"cubin": "kernel.cubin", "ptx": "kernel.ptx", "ltoir": "kernel.ltoir"}

#: Options that read or write files outside the key, or whose effect a hit
#: would silently skip. Value: why.
FORBIDDEN = {
    "--time": "writes compile timings to a file, which a cache hit would not do",
    "--fdevice-time-trace": "writes a time-trace file, which a cache hit would not do",
    "--create-pch": "writes a precompiled header file, which a cache hit would not do",
    "--use-pch": "reads a precompiled header whose content is not part of the key",
    "--pch-dir": "reads and writes precompiled headers in a directory outside the key",
    "--pch": "reads and writes precompiled headers outside the key",
    "--gpu-architecture": "the architecture goes in arch=, so that it is keyed once",
}
#: Short spellings -> canonical long ones, so equivalent option lists share keys.
ALIASES = {
    "-arch": "--gpu-architecture",
    "-G": "--device-debug",
    "-lineinfo": "--generate-line-info",
    "-D": "--define-macro",
    "-U": "--undefine-macro",
    "-I": "--include-path",
    "-include": "--pre-include",
    "-std": "--std",
    "-rdc": "--relocatable-device-code",
    "-dlto": "--dlink-time-opt",
    "-ewp": "--extensible-whole-program",
    "-maxrregcount": "--maxrregcount",
    "-ftz": "--ftz",
    "-prec-sqrt": "--prec-sqrt",
    "-prec-div": "--prec-div",
    "-fmad": "--fmad",
    "-use_fast_math": "--use_fast_math",
    "-w": "--disable-warnings",
    "-restrict": "--restrict",
    "-default-device": "--device-as-default-execution-space",
    "-no-source-include": "--no-source-include",
    "-time": "--time",
    "-fdevice-time-trace": "--fdevice-time-trace",
    "-create-pch": "--create-pch",
    "-use-pch": "--use-pch",
    "-pch-dir": "--pch-dir",
    "-pch": "--pch",
    "-Ofc": "--Ofast-compile",
    "-split-compile": "--split-compile",
    "-dopt": "--dopt",
    "-opt-info": "--optimization-info",
    "-err-no": "--display-error-number",
    "-no-err-no": "--no-display-error-number",
}
#: Single-letter options that take their value attached (``-DFOO``).
_ATTACHED = ("-D", "-U", "-I")
_DEBUG = ("--device-debug", "--generate-line-info")


class NVRTCError(KernelCacheError):
    """NVRTC rejected the program; ``log`` holds its diagnostics."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n{log}".rstrip())
        self.log = log


@dataclass(frozen=True)
class CompileResult:
    """A compiled program: ``binary`` (cubin, PTX or LTO-IR bytes) and what NVRTC said."""

    binary: bytes
    target: str
    log: str
    lowered_names: dict[str, str]
    hit: bool
    key: str
    entry: Entry

    def path(self) -> str:
        """A real file holding the binary, for loaders that need one."""
        return self.entry.path(_ARTIFACT[self.target])


@dataclass(frozen=True)
class Options:
    """Options split into what is passed on, what is keyed and what is searched."""

    passed: list[str]  # handed to NVRTC, include paths included
    keyed: list[str]  # canonical spellings, include paths and pre-includes removed
    include_dirs: list[str]
    pre_includes: list[str]
    no_source_include: bool
    debug: bool


def canonical_options(options: Iterable[str]) -> Options:
    """Validate ``options`` and split them; forbidden options raise ``ValueError``."""
    passed: list[str] = []
    keyed: list[str] = []
    dirs: list[str] = []
    pre: list[str] = []
    for option in options:
        if not isinstance(option, str):
            raise TypeError(f"NVRTC options must be str, not {type(option).__name__}: {option!r}")
        name, value = _split(option)
        if name in FORBIDDEN:
            raise ValueError(f"NVRTC option {option!r} cannot be cached: it {FORBIDDEN[name]}")
        if name == "--include-path":
            dirs.append(_need(option, value))
        elif name == "--pre-include":
            pre.append(_need(option, value))
        else:
            keyed.append(name if value is None else f"{name}={value}")
        passed.append(option)
    return Options(
        passed=passed,
        keyed=keyed,
        include_dirs=dirs,
        pre_includes=pre,
        no_source_include="--no-source-include" in keyed,
        debug=any(k.split("=", 1)[0] in _DEBUG for k in keyed),
    )


def _split(option: str) -> tuple[str, str | None]:
    for short in _ATTACHED:
        if option.startswith(short) and not option.startswith("--") and len(option) > 2:
            return ALIASES[short], option[2:].removeprefix("=")
    name, sep, value = option.partition("=")
    return ALIASES.get(name, name), (value if sep else None)


def _need(option: str, value: str | None) -> str:
    if not value:
        raise ValueError(f"NVRTC option {option!r} needs a value, e.g. -Idir or -include=x.h")
    return value


@dataclass(frozen=True)
class _Request:
    """One compile's inputs, validated and normalised."""

    src: bytes
    name: str
    arch: str
    target: str
    opts: Options
    hdrs: dict[str, bytes]
    dirs: list[str]
    exprs: list[str]


def _request(
    source: str | bytes,
    name: str,
    arch: str,
    target: str,
    options: Sequence[str],
    headers: Mapping[str, str | bytes] | None,
    include_dirs: Sequence[str | os.PathLike[str]],
    name_expressions: Sequence[str],
) -> _Request:
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
    return _Request(
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
    """The key :func:`compile` would use for these arguments, without compiling."""
    req = _request(source, name, arch, target, options, headers, include_dirs, name_expressions)
    return _key_for(req)


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
    req = _request(source, name, arch, target, options, headers, include_dirs, name_expressions)
    key = _key_for(req)
    if cache is None:
        from kernelcache._defaults import default_cache

        cache = default_cache()
    compiled = False

    def run() -> Entry:
        nonlocal compiled
        compiled = True
        return _compile_entry(req)

    entry = cache.get_or_compile(key, run)
    meta = entry.meta
    return CompileResult(
        binary=entry[_ARTIFACT[target]],
        target=target,
        log=str(meta.get("log", "")),
        lowered_names=dict(meta.get("lowered_names", {})),
        hit=not compiled,
        key=key,
        entry=entry,
    )


# Per process: the key of a request, revalidated by stat before reuse, so a
# warm call neither re-reads nor re-hashes headers (see _key_for).
_key_memo: dict[tuple[Any, ...], tuple[str, includes.Scan]] = {}
_KEY_MEMO_LIMIT = 1024
_key_memo_lock = threading.Lock()


def _key_for(req: _Request) -> str:
    """The key, reusing this process's earlier scan when no scanned file changed."""
    opts = req.opts
    memo_key = (
        os.getcwd(),
        req.src,
        req.name,
        req.arch,
        req.target,
        tuple(opts.keyed),
        tuple(sorted(req.hdrs.items())),
        tuple(req.dirs),
        tuple(req.exprs),
    )
    known = _key_memo.get(memo_key)
    if known is not None and includes.still_valid(known[1].checks, known[1].absent):
        return known[0]
    from kernelcache import toolchain

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
    key = builder.hexdigest()
    if found.memoizable:
        with _key_memo_lock:  # eviction iterates the dict: not atomic across threads
            if len(_key_memo) >= _KEY_MEMO_LIMIT:
                _key_memo.pop(next(iter(_key_memo)))
            _key_memo[memo_key] = (key, found)
    return key


def _compile_entry(req: _Request) -> Entry:
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
