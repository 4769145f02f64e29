"""NVRTC options in canonical form: what is passed to NVRTC, what is keyed, what is searched.

Equivalent spellings (``-I dir``, ``-Idir``, ``--include-path=dir``) share a key;
options that read or write files outside the key, or whose effect a hit would
skip, raise ``ValueError`` saying why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
