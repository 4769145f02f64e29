"""Issue 19: NVRTC and cuda.core keys hold every header the compiler reads, or nothing is cached.

Each test compiles through ``kernelcache.nvrtc.compile``, changes a header the
source reaches (by an unusual spelling, or through a symlinked folder and
``..``) and checks that what comes back is what a fresh NVRTC compile of the
same inputs gives. Sources the scanner cannot follow, or that name a time
macro, are compiled every time and counted as ``uncacheable``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from kernelcache import nvrtc
from kernelcache.cache import Cache
from kernelcache.nvrtc import key as nvrtc_key
from kernelcache.stores.memory import MemoryStore

KERNEL = """
#ifndef FOO
#define FOO 1
#endif
extern "C" __global__ void k(float* y) { y[threadIdx.x] = FOO * 3.0f; }
"""
OPTIONS = ["-Iinc"]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "proj"
    (root / "inc").mkdir(parents=True)
    monkeypatch.chdir(root)
    monkeypatch.delenv("KERNELCACHE_SLOPPINESS", raising=False)
    monkeypatch.setattr(nvrtc_key, "memo", nvrtc_key.KeyMemo())
    return root


@pytest.fixture
def cache() -> Cache:
    return Cache([MemoryStore()])


def fresh(source: str) -> bytes:
    """A plain NVRTC compile of ``source`` with the same arguments, no kernelcache involved."""
    from cuda.bindings import nvrtc as raw

    err, prog = raw.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    assert err == raw.nvrtcResult.NVRTC_SUCCESS
    try:
        args = [b"-arch=compute_90", *(o.encode() for o in OPTIONS)]
        (err,) = raw.nvrtcCompileProgram(prog, len(args), args)
        assert err == raw.nvrtcResult.NVRTC_SUCCESS
        err, size = raw.nvrtcGetPTXSize(prog)
        buf = bytearray(size)
        raw.nvrtcGetPTX(prog, buf)
    finally:
        raw.nvrtcDestroyProgram(prog)
    return bytes(buf).rstrip(b"\0")


def compile_(source: str, cache: Cache) -> nvrtc.CompileResult:
    """Through the cache; the binary must be what a fresh compile gives."""
    result = nvrtc.compile(
        source, name="k.cu", arch="compute_90", target="ptx", options=OPTIONS, cache=cache
    )
    assert result.binary == fresh(source), "a binary that differs from a fresh compile"
    return result


# 3. Every spelling of an include -------------------------------------------------------

UNDERSTOOD = [
    pytest.param('#/**/include "h.h"\n', id="comment-after-hash"),
    pytest.param('%:include "h.h"\n', id="digraph"),
    pytest.param('#inc\\\nlude "h.h"\n', id="splice-in-directive"),
    pytest.param("#include \\\n<h.h>\n", id="splice-before-name"),
    pytest.param('# /* why */ include /* here */ "h.h"\n', id="comments-inside"),
]


@pytest.mark.parametrize("spelling", UNDERSTOOD)
def test_spelled_includes_are_keyed(project: Path, cache: Cache, spelling: str) -> None:
    (project / "inc" / "h.h").write_text("#define FOO 2\n")
    source = spelling + KERNEL
    assert not compile_(source, cache).hit
    assert compile_(source, cache).hit
    (project / "inc" / "h.h").write_text("#define FOO 3\n")
    assert not compile_(source, cache).hit
    assert compile_(source, cache).hit


UNSURE = [
    pytest.param('#define H "h.h"\n#include H\n', id="computed-include"),
    pytest.param(
        '#define H "h.h"\n#if __has_include(H)\n#include "h.h"\n#endif\n', id="has-include-macro"
    ),
    pytest.param('#include "h.h" // fine\n#include "i.h" extra\n', id="extra-tokens"),
]


@pytest.mark.parametrize("spelling", UNSURE)
def test_what_the_scanner_cannot_follow_is_not_cached(
    project: Path, cache: Cache, spelling: str
) -> None:
    (project / "inc" / "h.h").write_text("#define FOO 2\n")
    (project / "inc" / "i.h").write_text("\n")
    source = spelling + KERNEL
    assert not compile_(source, cache).hit
    (project / "inc" / "h.h").write_text("#define FOO 3\n")
    assert not compile_(source, cache).hit
    assert cache.compile_stats()["uncacheable"] == 2
    assert len(nvrtc_key.memo) == 0
    with pytest.raises(ValueError, match="cannot follow"):
        nvrtc.cache_key(source, name="k.cu", arch="compute_90", target="ptx", options=OPTIONS)


# 4. Paths resolved as the compiler resolves them ------------------------------------------


@pytest.fixture
def symlinked(project: Path) -> Path:
    """inc/sub is a symlink to elsewhere/x; a header there includes "../g.h"."""
    (project / "elsewhere" / "x").mkdir(parents=True)
    (project / "elsewhere" / "x" / "k.h").write_text('#include "../g.h"\n')
    (project / "elsewhere" / "g.h").write_text("#define FOO 2\n")
    (project / "inc" / "g.h").write_text("#define FOO 7\n")  # where ".." goes on paper
    os.symlink(project / "elsewhere" / "x", project / "inc" / "sub")
    return project


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param('#include "sub/k.h"\n', id="header-in-symlinked-folder"),
        pytest.param('#include "sub/../g.h"\n', id="dotdot-after-symlink"),
        pytest.param("#include <sub/../g.h>\n", id="angle-dotdot-after-symlink"),
    ],
)
def test_dotdot_goes_up_from_the_symlinks_target(
    symlinked: Path, cache: Cache, spelling: str
) -> None:
    source = spelling + KERNEL
    assert not compile_(source, cache).hit
    (symlinked / "elsewhere" / "g.h").write_text("#define FOO 5\n")
    assert not compile_(source, cache).hit
    (symlinked / "inc" / "g.h").write_text("#define FOO 8\n")  # not read by the compiler
    compile_(source, cache)


def test_header_digest_follows_the_symlink_too(symlinked: Path) -> None:
    from kernelcache import cuda_core

    options = pytest.importorskip("cuda.core").ProgramOptions(arch="sm_90", include_path=["inc"])
    cuda_core.digests.clear()
    before = cuda_core.header_digest('#include "sub/k.h"\n', options)
    (symlinked / "elsewhere" / "g.h").write_text("#define FOO 6\n")
    assert cuda_core.header_digest('#include "sub/k.h"\n', options) != before


# 5. Time macros: one rule with the launcher -----------------------------------------------


@pytest.mark.parametrize(
    ("source", "header"),
    [
        pytest.param("__device__ const char t[] = __TIME__;\n", "", id="time-in-source"),
        pytest.param('#include "t.h"\n', "__device__ const char d[] = __DATE__;\n", id="header"),
        pytest.param("__device__ const char t[] = __TI\\\nME__;\n", "", id="spliced"),
        pytest.param(  # NVRTC 13 has no __TIMESTAMP__; naming it is enough to refuse
            "#ifdef __TIMESTAMP__\n__device__ const char s[] = __TIMESTAMP__;\n#endif\n",
            "",
            id="timestamp",
        ),
    ],
)
def test_time_macros_are_not_cached_unless_allowed(
    project: Path, cache: Cache, monkeypatch: pytest.MonkeyPatch, source: str, header: str
) -> None:
    (project / "inc" / "t.h").write_text(header)
    args = {"name": "k.cu", "arch": "compute_90", "target": "ptx", "options": OPTIONS}
    for _ in range(2):
        assert not nvrtc.compile(source + KERNEL, cache=cache, **args).hit  # type: ignore[arg-type]
    assert cache.compile_stats()["uncacheable"] == 2
    monkeypatch.setenv("KERNELCACHE_SLOPPINESS", "time_macros")
    assert not nvrtc.compile(source + KERNEL, cache=cache, **args).hit  # type: ignore[arg-type]
    assert nvrtc.compile(source + KERNEL, cache=cache, **args).hit  # type: ignore[arg-type]
    monkeypatch.delenv("KERNELCACHE_SLOPPINESS")  # withdrawn: the remembered key is not used
    assert not nvrtc.compile(source + KERNEL, cache=cache, **args).hit  # type: ignore[arg-type]
    assert cache.compile_stats()["uncacheable"] == 3


def test_header_digest_refuses_time_macros_unless_allowed(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernelcache import cuda_core

    options = pytest.importorskip("cuda.core").ProgramOptions(arch="sm_90")
    with pytest.raises(ValueError, match="__TIME__"):
        cuda_core.header_digest("const char* t = __TIME__;\n", options)
    monkeypatch.setenv("KERNELCACHE_SLOPPINESS", "time_macros")
    assert len(cuda_core.header_digest("const char* t = __TIME__;\n", options)) == 32
