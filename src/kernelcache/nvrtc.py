"""Cached NVRTC compiles: ``kernelcache.nvrtc.compile(source, arch="sm_90")``.

The key holds everything that changes the binary and nothing that does not:
NVRTC's version (from the library, plus the library's content hash), the
source and its ``name``, the options in canonical form, arch and target, the
name expressions, every in-memory header, and the *contents* of every header
file the source reaches through ``include_dirs`` or its own directory (found
by scanning ``#include`` directives, see :mod:`kernelcache.includes`: NVRTC 13.5
has no dependency output). Paths appear in the key only where they end up in
the binary (debug info, ``__FILE__``), so a copy of a project hits.

Lowered names of ``name_expressions`` are stored in the entry's metadata, so
they survive a hit (cuda.core's program cache drops them). Failed compiles
raise :class:`NVRTCError` with the log and are not cached.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelcache import includes
from kernelcache.errors import KernelCacheError
from kernelcache.keys import KeyBuilder

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


# Per process: the key of a call, revalidated by stat before reuse (see _key_for).
_key_memo: dict[tuple[Any, ...], tuple[str, includes.Scan]] = {}
_KEY_MEMO_LIMIT = 1024


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
    """Compile ``source`` with NVRTC, or return the cached result of the same compile."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, not {target!r}")
    if not isinstance(arch, str) or not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', not {arch!r}")
    if target == "cubin" and not arch.startswith("sm_"):
        raise ValueError(f"a cubin needs a real architecture (sm_XY), not {arch!r}")
    src = source.encode() if isinstance(source, str) else bytes(source)
    hdrs = {
        str(k): (v.encode() if isinstance(v, str) else bytes(v)) for k, v in (headers or {}).items()
    }
    exprs = [str(e) for e in name_expressions]
    opts = canonical_options(options)
    dirs = [os.fspath(d) for d in include_dirs] + opts.include_dirs
    if target == "ltoir" and "--dlink-time-opt" not in opts.keyed:
        opts.passed.append("-dlto")
        opts.keyed.append("--dlink-time-opt")
    key = _key_for(src, name, arch, target, opts, hdrs, dirs, exprs)
    if cache is None:
        from kernelcache._defaults import default_cache

        cache = default_cache()
    compiled = False

    def run() -> Entry:
        nonlocal compiled
        compiled = True
        return _compile_entry(src, name, arch, target, opts, hdrs, dirs, exprs)

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


def _key_for(
    src: bytes,
    name: str,
    arch: str,
    target: str,
    opts: Options,
    hdrs: dict[str, bytes],
    dirs: list[str],
    exprs: list[str],
) -> str:
    """The key, reusing this process's earlier scan when no scanned file changed."""
    memo_key = (
        os.getcwd(),
        src,
        name,
        arch,
        target,
        tuple(opts.keyed),
        tuple(sorted(hdrs.items())),
        tuple(dirs),
        tuple(exprs),
    )
    known = _key_memo.get(memo_key)
    if known is not None and includes.still_valid(known[1].checks, known[1].absent):
        return known[0]
    from kernelcache import toolchain

    source_dir = None if opts.no_source_include else os.path.dirname(name)
    found = includes.scan(
        src,
        source_dir=source_dir,
        include_dirs=dirs,
        headers=hdrs,
        pre_includes=opts.pre_includes,
        path_sensitive=opts.debug,
    )
    builder = KeyBuilder("kernelcache.nvrtc")
    builder.add("nvrtc", toolchain.nvrtc())
    builder.add("source", src).add("name", name).add("arch", arch).add("target", target)
    builder.add("options", opts.keyed).add("name_expressions", exprs)
    builder.add("headers", hdrs).add("included", [list(row) for row in found.rows])
    builder.add("pre_includes", opts.pre_includes)
    # Debug info and __FILE__ name files by the path NVRTC saw.
    builder.add("paths", found.paths + ([os.getcwd()] if opts.debug else []))
    key = builder.hexdigest()
    if found.memoizable:
        if len(_key_memo) >= _KEY_MEMO_LIMIT:
            _key_memo.pop(next(iter(_key_memo)))
        _key_memo[memo_key] = (key, found)
    return key


def _compile_entry(
    src: bytes,
    name: str,
    arch: str,
    target: str,
    opts: Options,
    hdrs: dict[str, bytes],
    dirs: list[str],
    exprs: list[str],
) -> Entry:
    from cuda.bindings import nvrtc as _nvrtc

    from kernelcache.entry import Entry

    ok = _nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = _nvrtc.nvrtcCreateProgram(
        src, name.encode(), len(hdrs), list(hdrs.values()), [k.encode() for k in hdrs]
    )
    _check(_nvrtc, err, "nvrtcCreateProgram")
    try:
        for expr in exprs:
            _check(
                _nvrtc,
                _nvrtc.nvrtcAddNameExpression(prog, expr.encode())[0],
                "nvrtcAddNameExpression",
            )
        args = [f"-arch={arch}", *(f"-I{d}" for d in dirs[: len(dirs) - len(opts.include_dirs)])]
        args += opts.passed
        (err,) = _nvrtc.nvrtcCompileProgram(prog, len(args), [a.encode() for a in args])
        log = _program_log(_nvrtc, prog)
        if err != ok:
            raise NVRTCError(f"NVRTC failed to compile {name!r} ({_result_name(err)})", log)
        binary = _binary(_nvrtc, prog, target)
        lowered = {}
        for expr in exprs:
            err, raw = _nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(_nvrtc, err, "nvrtcGetLoweredName")
            lowered[expr] = raw.decode() if isinstance(raw, bytes) else str(raw)
    finally:
        _nvrtc.nvrtcDestroyProgram(prog)
    meta: dict[str, Any] = {"compiler": "nvrtc", "name": name, "arch": arch, "target": target}
    meta.update(log=log, lowered_names=lowered)
    return Entry({_ARTIFACT[target]: binary}, meta)


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
