"""A real CMake + Ninja project built through ``CMAKE_CUDA_COMPILER_LAUNCHER=kernelcache``.

The launcher is the ``kernelcache`` executable as installed (shell front,
client, server). CMake writes ``-forward-unknown-to-host-compiler`` and here
a host flag (``-Wall``), which must be cached. Ninja reads the dependency
files the launcher restores (``deps = gcc``), so "edit the header, exactly the
dependent objects rebuild" also checks that the restored ``.d`` files are right.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher_env import clean_env, make_bin, stats, stop_server

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("cmake", "ninja", "nvcc")),
    reason="needs cmake, ninja and nvcc",
)

CMAKELISTS = """cmake_minimum_required(VERSION 3.20)
project(launcher_test LANGUAGES CUDA)
add_library(kernels STATIC src/add.cu src/scale.cu src/fill.cu)
target_include_directories(kernels PRIVATE include)
target_compile_options(kernels PRIVATE -Wall)
"""
COMMON = "#pragma once\n__device__ inline float twice(float v) { return 2.0f * v; }\n"
SOURCES = {
    "add.cu": '#include "common.cuh"\n__global__ void add(float* x, const float* y)'
    " { x[threadIdx.x] = twice(x[threadIdx.x]) + y[threadIdx.x]; }\n",
    "scale.cu": '#include "common.cuh"\n__global__ void scale(float* x)'
    " { x[threadIdx.x] = twice(x[threadIdx.x]); }\n",
    "fill.cu": "__global__ void fill(float* x, float v) { x[threadIdx.x] = v; }\n",
}
OBJECTS = {name: f"CMakeFiles/kernels.dir/src/{name}.o" for name in SOURCES}


def _stats(cache_dir: Path) -> dict[str, int]:
    counts = stats(cache_dir)
    return {k: counts[k] for k in ("hits", "misses", "uncacheable", "failed")}


def _built(output: str) -> set[str]:
    return {
        name
        for name in SOURCES
        if f"Building CUDA object CMakeFiles/kernels.dir/src/{name}.o" in output
    }


@pytest.fixture
def project(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "CMakeLists.txt").write_text(CMAKELISTS)
    (root / "include" / "common.cuh").write_text(COMMON)
    for name, text in SOURCES.items():
        (root / "src" / name).write_text(text)
    launcher = make_bin(tmp_path / "bin")
    env = clean_env(tmp_path / "cache")
    env.pop("CUDAFLAGS", None)
    subprocess.run(
        [
            "cmake",
            "-S",
            str(root),
            "-B",
            str(root / "build"),
            "-G",
            "Ninja",
            f"-DCMAKE_CUDA_COMPILER_LAUNCHER={launcher}",
            "-DCMAKE_CUDA_ARCHITECTURES=90",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    time.sleep(0.05)  # sources older than the first compile's start (nvcc_deps.RACE_SLOP_NS)
    yield root, env
    stop_server(env["KERNELCACHE_DIR"])


def build(root: Path, env: dict[str, str], *target: str) -> str:
    proc = subprocess.run(
        ["cmake", "--build", str(root / "build"), "--", "-j2", *target],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def objects(root: Path) -> dict[str, bytes]:
    return {name: (root / "build" / path).read_bytes() for name, path in OBJECTS.items()}


def test_cold_clean_warm_then_header_edit(project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    cache_dir = Path(env["KERNELCACHE_DIR"])

    assert _built(build(root, env)) == set(SOURCES)
    assert _stats(cache_dir) == {"hits": 0, "misses": 3, "uncacheable": 0, "failed": 0}
    cold = objects(root)

    build(root, env, "clean")
    assert not (root / "build" / OBJECTS["add.cu"]).exists()
    assert _built(build(root, env)) == set(SOURCES)
    assert _stats(cache_dir) == {"hits": 3, "misses": 3, "uncacheable": 0, "failed": 0}
    assert objects(root) == cold, "warm objects must be byte-identical to the cold ones"

    # Ninja now knows the dependencies from the restored .d files.
    assert "no work to do" in build(root, env)
    fill_mtime = (root / "build" / OBJECTS["fill.cu"]).stat().st_mtime_ns
    (root / "include" / "common.cuh").write_text(COMMON.replace("2.0f", "3.0f"))
    time.sleep(0.05)
    assert _built(build(root, env)) == {"add.cu", "scale.cu"}
    assert _stats(cache_dir) == {"hits": 3, "misses": 5, "uncacheable": 0, "failed": 0}
    assert (root / "build" / OBJECTS["fill.cu"]).stat().st_mtime_ns == fill_mtime
    edited = objects(root)
    assert edited["add.cu"] != cold["add.cu"]
    assert edited["fill.cu"] == cold["fill.cu"]


def test_comment_only_header_edit_rebuilds_every_dependent_as_a_hit(
    project: tuple[Path, dict[str, str]],
) -> None:
    """ccache's preprocessed mode: the direct key misses, nvcc's preprocessing matches."""
    root, env = project
    cache_dir = Path(env["KERNELCACHE_DIR"])
    build(root, env)
    cold = objects(root)
    header = root / "include" / "common.cuh"
    header.write_text(COMMON.replace("#pragma once", "#pragma once  // twice: doubles a value"))
    time.sleep(0.05)
    assert _built(build(root, env)) == {"add.cu", "scale.cu"}  # Ninja: the header changed
    counts = stats(cache_dir)
    assert (counts["misses"], counts["hits"], counts["preprocessed_hits"]) == (3, 2, 2)
    assert objects(root) == cold
    # The manifests learned the edited header: the next clean build hits directly.
    build(root, env, "clean")
    assert _built(build(root, env)) == set(SOURCES)
    counts = stats(cache_dir)
    assert (counts["misses"], counts["hits"], counts["preprocessed_hits"]) == (3, 5, 2)
    assert objects(root) == cold
