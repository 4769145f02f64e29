"""Cached NVRTC: keys (table-driven), real compiles, hits across caches, errors, GPU launch."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from kernelcache import _fs, nvrtc, toolchain
from kernelcache.cache import Cache
from kernelcache.nvrtc import includes
from kernelcache.nvrtc import key as nvrtc_key
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

SOURCE = """#include "common.cuh"
#include <limits.cuh>
template <typename T>
__global__ void scale(T* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && n < LIMIT) x[i] = x[i] * SCALE;
}
"""
COMMON = '#pragma once\n#include "detail/inner.cuh"\n#define SCALE 2.0f\n'
INNER = "#pragma once\n#define INNER 1\n"
LIMITS = "#pragma once\n#define LIMIT 1000000\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _age(root: Path) -> None:
    """Let the files' stat vouch for their content (kernelcache._fs.TOO_NEW_NS)."""
    old = time.time() - 3600
    for path in root.rglob("*"):
        os.utime(path, (old, old))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """src/ holds the kernel's directory and common.cuh; inc/ is an include dir."""
    root = tmp_path / "proj"
    _write(root / "src" / "common.cuh", COMMON)
    _write(root / "src" / "detail" / "inner.cuh", INNER)
    _write(root / "src" / "unrelated.h", "#define UNRELATED 1\n")
    _write(root / "inc" / "limits.cuh", LIMITS)
    _write(root / "inc" / "other.cuh", "#define OTHER 1\n")
    monkeypatch.chdir(root)
    return root


def key(**overrides: object) -> str:
    args: dict[str, object] = {
        "name": "src/scale.cu",
        "include_dirs": ["inc"],
        "name_expressions": ["scale<float>"],
    }
    args.update(overrides)
    source = args.pop("source", SOURCE)
    return nvrtc.cache_key(source, **args)  # type: ignore[arg-type]


def _edit(path: str, text: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        (root / path).write_text(text)

    return apply


MUST_DIFFER = [
    pytest.param(
        _edit("src/common.cuh", COMMON.replace("2.0f", "3.0f")), id="included-header-edit"
    ),
    pytest.param(_edit("src/detail/inner.cuh", INNER + "// x\n"), id="transitive-header-edit"),
    pytest.param(
        _edit("inc/limits.cuh", LIMITS.replace("1000000", "7")), id="include-dir-header-edit"
    ),
    pytest.param(
        _edit("src/common.cuh", COMMON.replace("2.0f", "4.0f")), id="same-size-edit-in-place"
    ),
    pytest.param(
        lambda root: _write(root / "inc" / "common.cuh", COMMON),
        id="new-candidate-in-a-searched-dir",
    ),
]

MUST_MATCH = [
    pytest.param(_edit("src/unrelated.h", "#define UNRELATED 2\n"), id="unrelated-file-same-dir"),
    pytest.param(_edit("inc/other.cuh", "#define OTHER 2\n"), id="unrelated-file-include-dir"),
    pytest.param(lambda root: (root / "notes.txt").write_text("x"), id="new-unrelated-file"),
]


@pytest.fixture(params=["rescan", "memoized"])
def scan_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run file-change tests both on a fresh scan and through the per-process key memo.

    Files written by a test are seconds old at most, too fresh for their stat
    to vouch for them, so "memoized" lifts that rule: the memo must then
    notice every change from ``stat`` alone.
    """
    monkeypatch.setattr(nvrtc_key, "memo", nvrtc_key.KeyMemo())
    monkeypatch.setattr(includes, "_parsed", {})
    if request.param == "memoized":
        monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)
    return str(request.param)


@pytest.mark.parametrize("change", MUST_DIFFER)
def test_file_changes_that_must_change_the_key(
    project: Path, scan_mode: str, change: Callable[[Path], None]
) -> None:
    _age(project)
    before = key()
    assert bool(len(nvrtc_key.memo)) == (scan_mode == "memoized")
    change(project)
    assert key() != before


@pytest.mark.parametrize("change", MUST_MATCH)
def test_file_changes_that_must_keep_the_key(
    project: Path, scan_mode: str, change: Callable[[Path], None]
) -> None:
    _age(project)
    before = key()
    change(project)
    assert key() == before


ARGUMENTS_THAT_DIFFER = [
    pytest.param({"arch": "sm_80"}, id="arch"),
    pytest.param({"options": ["-DEXTRA=1"]}, id="define"),
    pytest.param({"options": ["--use_fast_math"]}, id="fast-math"),
    pytest.param({"target": "ptx"}, id="target"),
    pytest.param({"name_expressions": ["scale<double>"]}, id="name-expressions"),
    pytest.param({"name": "src/other.cu"}, id="name"),
    pytest.param({"source": SOURCE + "\n// comment\n"}, id="source"),
    pytest.param({"headers": {"extra.h": "#define E 1\n"}}, id="in-memory-header"),
    pytest.param({"options": ["-lineinfo"]}, id="line-info"),
]


@pytest.mark.parametrize("overrides", ARGUMENTS_THAT_DIFFER)
def test_arguments_that_must_change_the_key(project: Path, overrides: dict[str, object]) -> None:
    assert key(**overrides) != key()


ARGUMENTS_THAT_MATCH = [
    pytest.param({"options": ["-DEXTRA=1"]}, {"options": ["--define-macro=EXTRA=1"]}, id="alias"),
    pytest.param({"options": ["-G"]}, {"options": ["--device-debug"]}, id="short-long"),
    pytest.param({}, {"include_dirs": [], "options": ["-Iinc"]}, id="include-dir-as-option"),
    pytest.param(
        {"headers": {"a.h": "x", "b.h": "y"}},
        {"headers": {"b.h": "y", "a.h": "x"}},
        id="header-order",
    ),
]


@pytest.mark.parametrize(("left", "right"), ARGUMENTS_THAT_MATCH)
def test_arguments_that_must_keep_the_key(
    project: Path, left: dict[str, object], right: dict[str, object]
) -> None:
    assert key(**left) == key(**right)


def test_absolute_include_dir_keys_like_relative(project: Path) -> None:
    assert key(include_dirs=[str(project / "inc")]) == key()


def test_copied_project_gives_the_same_key(project: Path, tmp_path: Path) -> None:
    original = key()
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(project, copy)
    os.chdir(copy)
    assert key() == original
    assert key(include_dirs=[str(copy / "inc")]) == original


def test_file_macro_in_a_header_puts_its_path_in_the_key(project: Path, tmp_path: Path) -> None:
    (project / "inc" / "limits.cuh").write_text(LIMITS + "static const char* where = __FILE__;\n")
    absolute = key(include_dirs=[str(project / "inc")])
    copy = tmp_path / "copy"
    shutil.copytree(project, copy)
    # __FILE__ expands to the absolute path here: another location must miss.
    assert key(include_dirs=[str(copy / "inc")]) != absolute


@pytest.mark.parametrize(
    "option",
    [
        "--time=t.csv",
        "-time=t.csv",
        "--create-pch=x.pch",
        "--use-pch=x.pch",
        "--pch-dir=d",
        "-pch",
        "--fdevice-time-trace=t.json",
        "-arch=sm_80",
    ],
)
def test_options_with_side_effects_are_refused(project: Path, option: str) -> None:
    with pytest.raises(ValueError, match="cannot be cached"):
        key(options=[option])


def test_computed_include_is_refused(project: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot follow.*#include H"):
        key(source="#define H <limits.cuh>\n#include H\n" + SOURCE)


def test_pre_include_needs_content(project: Path) -> None:
    with pytest.raises(ValueError, match="pre-included"):
        key(options=["-include=missing.h"])
    assert key(options=["-include=other.cuh"]) != key()


def test_bad_arguments(project: Path) -> None:
    with pytest.raises(ValueError, match="target"):
        key(target="sass")
    with pytest.raises(ValueError, match="real architecture"):
        key(arch="compute_90")
    with pytest.raises(TypeError):
        key(options="-DX")


# Real compiles ------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    with Cache([MemoryStore(), DiskStore(tmp_path / "cache")]) as c:
        yield c


def compile_(cache: Cache, **overrides: object) -> nvrtc.CompileResult:
    args: dict[str, object] = {
        "name": "src/scale.cu",
        "include_dirs": ["inc"],
        "name_expressions": ["scale<float>"],
        "cache": cache,
    }
    args.update(overrides)
    return nvrtc.compile(SOURCE, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["cubin", "ptx", "ltoir"])
def test_cold_then_warm(project: Path, cache: Cache, target: str) -> None:
    cold = compile_(cache, target=target)
    warm = compile_(cache, target=target)
    assert (cold.hit, warm.hit) == (False, True)
    assert warm.binary == cold.binary
    assert len(cold.binary) > 100
    assert warm.lowered_names == cold.lowered_names == {"scale<float>": "_Z5scaleIfEvPT_i"}
    if target == "ptx":
        assert b".entry _Z5scaleIfEvPT_i" in cold.binary
    assert os.path.getsize(warm.path()) == len(cold.binary)


def test_lowered_names_and_log_survive_a_disk_hit(project: Path, tmp_path: Path) -> None:
    source = SOURCE + "__global__ void unused_warning() { int x; }\n"
    with Cache([MemoryStore(), DiskStore(tmp_path / "shared")]) as first:
        cold = nvrtc.compile(
            source,
            name="src/w.cu",
            include_dirs=["inc"],
            name_expressions=["scale<double>"],
            cache=first,
        )
    with Cache([MemoryStore(), DiskStore(tmp_path / "shared")]) as second:  # "another process"
        warm = nvrtc.compile(
            source,
            name="src/w.cu",
            include_dirs=["inc"],
            name_expressions=["scale<double>"],
            cache=second,
        )
    assert warm.hit
    assert not cold.hit
    assert warm.lowered_names == {"scale<double>": "_Z5scaleIdEvPT_i"}
    assert "warning" in cold.log
    assert warm.log == cold.log
    assert warm.binary == cold.binary


def test_header_edit_recompiles_and_unrelated_edit_hits(project: Path, cache: Cache) -> None:
    _age(project)
    first = compile_(cache)
    (project / "src" / "unrelated.h").write_text("#define UNRELATED 3\n")
    assert compile_(cache).hit
    (project / "src" / "common.cuh").write_text(COMMON.replace("2.0f", "5.0f"))
    edited = compile_(cache)
    assert not edited.hit
    assert edited.binary != first.binary


def test_errors_carry_the_log_and_are_not_cached(project: Path, cache: Cache) -> None:
    bad = "__global__ void k() { undefined_symbol(); }\n"
    for _ in range(2):
        with pytest.raises(nvrtc.NVRTCError, match="undefined_symbol") as info:
            nvrtc.compile(bad, cache=cache)
        assert "identifier" in info.value.log
    assert cache.get(nvrtc.cache_key(bad)) is None


def test_default_cache_respects_kernelcache_dir(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "default"))
    result = nvrtc.compile("__global__ void k(int* p) { *p = 1; }\n")
    assert (tmp_path / "default" / "v1").is_dir()
    assert nvrtc.compile("__global__ void k(int* p) { *p = 1; }\n").hit
    assert not result.hit


def test_warm_hit_skips_scanning_and_hashing(
    project: Path, cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a benchmark: the warm path re-reads no header and re-hashes no file."""
    cold = compile_(cache)
    # utime() sets mtime, but ctime becomes "now": lift the too-new rule instead.
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)
    compile_(cache)  # memoise the scan now that the files' stat vouches for them
    scans: list[str] = []
    real_scan = includes.scan

    def counted_scan(*args: Any, **kwargs: Any) -> Any:
        scans.append("scan")
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(includes, "scan", counted_scan)
    for _ in range(200):
        assert compile_(cache).hit
    assert scans == []
    assert cold.hit is False


GPU = toolchain.gpu_arch()


@pytest.mark.skipif(GPU.startswith("probe_failed"), reason=f"no GPU here ({GPU})")
def test_cached_cubin_runs_on_the_gpu(tmp_path: Path) -> None:
    import ctypes

    import numpy as np
    from cuda.bindings import driver as cu

    def ok(result: tuple[Any, ...]) -> Any:  # cuda.bindings: untyped results
        assert result[0] == cu.CUresult.CUDA_SUCCESS, result[0]
        return result[1] if len(result) == 2 else result[1:]

    src = (
        'extern "C" __global__ void twice(float* x, int n)'
        " { int i = threadIdx.x; if (i < n) x[i] *= 2; }"
    )
    with Cache([MemoryStore(), DiskStore(tmp_path / "gpu")]) as cache:
        nvrtc.compile(src, arch=GPU, cache=cache)
        warm = nvrtc.compile(src, arch=GPU, cache=cache)
    assert warm.hit
    ok(cu.cuInit(0))
    ctx = ok(cu.cuCtxCreate(None, 0, ok(cu.cuDeviceGet(0))))
    try:
        module = ok(cu.cuModuleLoadData(warm.binary))
        func = ok(cu.cuModuleGetFunction(module, b"twice"))
        host = np.arange(32, dtype=np.float32)
        dev = ok(cu.cuMemAlloc(host.nbytes))
        ok(cu.cuMemcpyHtoD(dev, host.ctypes.data, host.nbytes))
        ptr = ctypes.c_void_p(int(dev))
        count = ctypes.c_int(32)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(count))
        ok(cu.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, 0, ctypes.addressof(params), 0))
        out = np.empty_like(host)
        ok(cu.cuMemcpyDtoH(out.ctypes.data, dev, host.nbytes))
        assert (out == host * 2).all()
    finally:
        cu.cuCtxDestroy(ctx)


def test_threads_get_one_consistent_result(project: Path, cache: Cache) -> None:
    from concurrent.futures import ThreadPoolExecutor

    source = SOURCE + "// threads\n"
    with ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(
                lambda _: nvrtc.compile(source, name="src/t.cu", include_dirs=["inc"], cache=cache),
                range(12),
            )
        )
    assert len({r.binary for r in results}) == 1
    assert len({r.key for r in results}) == 1
    assert any(r.hit for r in results)


@pytest.mark.parametrize(
    ("options", "head", "created"),
    [
        pytest.param(["-include=other.cuh"], "", "a/other.cuh", id="pre-include"),
        pytest.param(["--pre-include=other.cuh"], "", "src/other.cuh", id="pre-include-beside"),
        pytest.param([], "#include_next <limits.cuh>\n", "a/limits.cuh", id="include-next-main"),
        pytest.param([], '#include_next "limits.cuh"\n', "src/limits.cuh", id="next-quoted"),
    ],
)
def test_a_header_created_earlier_along_any_lookup(
    project: Path, options: list[str], head: str, created: str
) -> None:
    """Issue 40, for NVRTC: every candidate of every lookup is in the key (hashed if it
    exists, its folder watched if not), so no search order needs modelling."""
    (project / "a").mkdir()
    source = head + SOURCE.replace("#include <limits.cuh>\n", "")
    before = key(source=source, options=options, include_dirs=["a", "inc"])
    _write(project / created, "#define LIMIT 7\n#define OTHER 2\n")
    assert key(source=source, options=options, include_dirs=["a", "inc"]) != before
