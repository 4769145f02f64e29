"""Cached NVRTC compiles: ``kernelcache.nvrtc.compile(source, arch="sm_90")``.

The compile and its key are in ``compiler.py``; NVRTC reports no dependencies,
so the headers a source reaches are found by ``includes.py``.
"""

from __future__ import annotations

from kernelcache.nvrtc.compiler import (
    ALIASES,
    FORBIDDEN,
    TARGETS,
    CompileResult,
    NVRTCError,
    Options,
    cache_key,
    canonical_options,
    compile,
)

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
