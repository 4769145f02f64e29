"""LLM servers' JIT compiles through the launcher, as the libraries run them (issue 37).

Real nvcc compiles through the stand-in toolkit whose nvcc counts its runs
(``cuda_standin``), and the ``kernelcache`` front as pip installs it
(``launcher_env``):

- DeepGEMM: ``<compiler> <cache>/tmp/<uuid>/kernel.cu -cubin -o <cache>/tmp/<uuid>/kernel.cubin``
  from ``<cache>/tmp``, a new uuid folder each time: a second folder runs no nvcc
  and gets plain nvcc's cubin; a kernel whose output names its folder (``__FILE__``)
  is never served across folders; eight ranks at once run nvcc once.
- FlashInfer: its ninja rule (``$nvcc_launcher $nvcc --generate-dependencies-with-compile
  -MF $out.d ... -c $in -o $out``) on machine A, then on machine B (a fresh cache
  directory, the same Redis and paths): no nvcc run, and the next ``ninja`` has
  nothing to do; sources copied again with new mtimes: no nvcc run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuda_standin import Toolkit, make_toolkit
from launcher_env import clean_env, make_bin, start_server, stop_server, without_file_symbol
from redis_server import LOADED, RedisServer, unique_namespace

pytestmark = [
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH"),
    pytest.mark.slow,
]

KERNEL = """template <int N>
__global__ void scale_kernel(float* x) {
    x[threadIdx.x] *= static_cast<float>(N) + %s;
}
template __global__ void scale_kernel<%d>(float*);
"""
FILE_KERNEL = "__global__ void where(const char** out) { *out = __FILE__; }\n"
DG_FLAGS = [
    "-std=c++17",
    "--diag-suppress=39,161,174,177,186,940",
    "--ptxas-options=-O3",
    "-O3",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-gencode=arch=compute_90a,code=sm_90a",
]


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory: pytest.TempPathFactory) -> Toolkit:
    return make_toolkit(tmp_path_factory.mktemp("llm-cuda"), libcuda_stub=False)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bin(tmp_path_factory.mktemp("llm-bin") / "bin")


class Machine:
    """One machine's cache directory (and the team's Redis, when given)."""

    def __init__(self, root: Path, toolkit: Toolkit, remote: str | None = None) -> None:
        self.cache = root / "kernelcache"
        extra = {"KERNELCACHE_REMOTE": remote} if remote else {}
        self.env = toolkit.env(clean_env(self.cache, **extra))
        self.stats_file = self.cache / "nvcc-stats.json"

    def stats(self) -> dict[str, object]:
        if not self.stats_file.exists():
            return {}
        data: dict[str, object] = json.loads(self.stats_file.read_text())
        return data

    def close(self) -> None:
        stop_server(self.cache)


@pytest.fixture
def machine(tmp_path: Path, toolkit: Toolkit) -> Iterator[Machine]:
    found = Machine(tmp_path / "a", toolkit)
    try:
        yield found
    finally:
        found.close()


def deepgemm(front: Path, toolkit: Toolkit, m: Machine, folder: Path) -> subprocess.Popen[bytes]:
    """DeepGEMM's compile of ``folder/kernel.cu``, run from the folder's parent."""
    nvcc = str(toolkit.root / "bin" / "nvcc")
    source, cubin = str(folder / "kernel.cu"), str(folder / "kernel.cubin")
    argv = [str(front), nvcc, source, "-cubin", "-o", cubin, *DG_FLAGS]
    return subprocess.Popen(argv, cwd=folder.parent, env=m.env, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()


def new_folder(tmp: Path, text: str) -> Path:
    folder = tmp / os.urandom(8).hex()
    folder.mkdir(parents=True)
    (folder / "kernel.cu").write_text(text)
    time.sleep(0.05)  # older than the compile's start (nvcc_deps.RACE_SLOP_NS)
    return folder


def plain_cubin(folder: Path) -> bytes:
    """What plain nvcc writes for ``folder/kernel.cu`` (not counted: the real nvcc)."""
    out = folder / "plain.cubin"
    subprocess.run(
        ["nvcc", str(folder / "kernel.cu"), "-cubin", "-o", str(out), *DG_FLAGS], check=True
    )
    return out.read_bytes()


def test_deepgemm_new_uuid_folders_hit_with_plain_nvccs_cubin(
    tmp_path: Path, front: Path, toolkit: Toolkit, machine: Machine
) -> None:
    tmp = tmp_path / "dg-cache" / "tmp"
    first = new_folder(tmp, KERNEL % ("1.0f", 1))
    toolkit.reset()
    finish(deepgemm(front, toolkit, machine, first))
    assert len(toolkit.compiles()) == 1
    for _ in range(2):  # a fresh process (no server yet), then through the server
        again = new_folder(tmp, KERNEL % ("1.0f", 1))
        finish(deepgemm(front, toolkit, machine, again))
        assert len(toolkit.compiles()) == 1, toolkit.compiles()
        assert (again / "kernel.cubin").read_bytes() == plain_cubin(again)
    assert machine.stats()["hits"] == 2


def test_an_output_that_names_its_folder_is_never_served_across_folders(
    tmp_path: Path, front: Path, toolkit: Toolkit, machine: Machine
) -> None:
    tmp = tmp_path / "dg-cache" / "tmp"
    folders = [new_folder(tmp, FILE_KERNEL) for _ in range(2)]
    toolkit.reset()
    for folder in folders:
        finish(deepgemm(front, toolkit, machine, folder))
    assert len(toolkit.compiles()) == 2  # the second folder compiled again
    for folder in folders:
        cubin = (folder / "kernel.cubin").read_bytes()
        assert os.fsencode(folder) in cubin
        assert cubin == plain_cubin(folder)
    # Its own folder still hits.
    (folders[0] / "kernel.cubin").unlink()
    finish(deepgemm(front, toolkit, machine, folders[0]))
    assert len(toolkit.compiles()) == 2
    assert os.fsencode(folders[0]) in (folders[0] / "kernel.cubin").read_bytes()


@pytest.mark.parametrize("server", [False, True], ids=["first-calls", "through-the-server"])
def test_eight_ranks_in_eight_uuid_folders_run_nvcc_once(
    tmp_path: Path, front: Path, toolkit: Toolkit, machine: Machine, server: bool
) -> None:
    """The first calls run the launcher in-process (no server yet): they wait in the
    claim; through a running server, it holds the claim for the client it plans."""
    if server:
        start_server(machine.cache, machine.env)
    tmp = tmp_path / "dg-cache" / "tmp"
    text = KERNEL % ("2.5f", 7)
    folders = [new_folder(tmp, text) for _ in range(8)]
    toolkit.reset()
    ranks = [deepgemm(front, toolkit, machine, folder) for folder in folders]
    for rank in ranks:
        finish(rank)
    assert len(toolkit.compiles()) == 1, toolkit.compiles()
    expected = plain_cubin(folders[0])
    for folder in folders:
        assert (folder / "kernel.cubin").read_bytes() == expected
    stats = machine.stats()
    assert (stats["misses"], stats["hits"]) == (1, 7), stats
    if server:  # its log, as it exits: the clients it did not plan a compile for
        assert stop_server(machine.cache)
        log = (machine.cache / "launcher.log").read_text()
        assert re.search(r"answered python client .*fallback=[1-9]", log), log


# FlashInfer's ninja build --------------------------------------------------------

HEADER = "#pragma once\n__device__ inline float act(float v) { return v > 0.f ? v : 0.f; }\n"
SOURCE = '#include "act.cuh"\n__global__ void act_kernel(float* x) { x[threadIdx.x] = act(x[threadIdx.x]); }\n'
NINJA = """ninja_required_version = 1.3
nvcc = {nvcc}
nvcc_launcher = {launcher}
cuda_cflags = -isystem {include} -I{generated} --compiler-options=-fPIC --expt-relaxed-constexpr -static-global-template-stub=false -gencode=arch=compute_90a,code=sm_90a --threads=1 -use_fast_math -Xfatbin=-compress-all --compress-mode=size -O3

rule cuda_compile
  command = $nvcc_launcher $nvcc --generate-dependencies-with-compile -MF $out.d $cuda_cflags -c $in -o $out
  depfile = $out.d
  deps = gcc

build {build}/act.cuda.o: cuda_compile {generated}/act.cu
"""


def write_module(root: Path, front: Path, toolkit: Toolkit) -> Path:
    """FlashInfer's layout: sources under ``generated/``, a build folder with ``build.ninja``."""
    generated, build, include = root / "generated", root / "build", root / "site" / "include"
    for folder in (generated, build, include):
        folder.mkdir(parents=True, exist_ok=True)
    (generated / "act.cu").write_text(SOURCE)
    (generated / "act.cuh").write_text(HEADER)
    (include / "unused.h").write_text("#pragma once\n")
    nvcc = toolkit.root / "bin" / "nvcc"
    text = NINJA.format(
        nvcc=nvcc, launcher=front, include=include, generated=generated, build=build
    )
    (build / "build.ninja").write_text(text)
    time.sleep(0.05)
    return build


def ninja(build: Path, m: Machine) -> str:
    done = subprocess.run(
        ["ninja", "-C", str(build)], env=m.env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not on PATH")
def test_flashinfer_ninja_build_on_a_second_machine_runs_no_nvcc(
    tmp_path: Path, front: Path, toolkit: Toolkit, redis_server: RedisServer
) -> None:
    # Generous: a put or get past the default 0.5 s on a loaded machine is dropped, and
    # machine B would compile again (redis_server.LOADED; this test is not about timeouts).
    remote = f"{redis_server.url}?namespace={unique_namespace()}&timeout={LOADED:g}"
    build = write_module(tmp_path / "ws", front, toolkit)
    a, b = Machine(tmp_path / "a", toolkit, remote), Machine(tmp_path / "b", toolkit, remote)
    try:
        toolkit.reset()
        ninja(build, a)
        assert len(toolkit.compiles()) == 1
        built = (build / "act.cuda.o").read_bytes()
        assert a.stats().get("uncacheable", 0) == 0, a.stats()
        # Machine B: the same paths, its own empty cache directory, the same Redis.
        (build / "act.cuda.o").unlink()
        ninja(build, b)
        assert len(toolkit.compiles()) == 1, toolkit.compiles()
        assert b.stats()["hits"] == 1
        assert without_file_symbol((build / "act.cuda.o").read_bytes()) == without_file_symbol(
            built
        )
        assert "no work to do" in ninja(build, b)
        # Sources copied again (new mtimes, same bytes), objects removed: no nvcc run.
        generated = build.parent / "generated"
        for name in ("act.cu", "act.cuh"):
            data = (generated / name).read_bytes()
            (generated / name).unlink()
            (generated / name).write_bytes(data)
        (build / "act.cuda.o").unlink()
        time.sleep(0.05)
        ninja(build, b)
        assert len(toolkit.compiles()) == 1, toolkit.compiles()
        assert "no work to do" in ninja(build, b)
        # A header that really changes: ninja rebuilds, and nvcc runs.
        time.sleep(1.1)  # a newer mtime than the object's, at ninja's granularity
        (generated / "act.cuh").write_text(HEADER.replace("? v : 0.f", "? v : 0.5f"))
        time.sleep(0.05)
        assert "no work to do" not in ninja(build, b)
        assert len(toolkit.compiles()) == 2
    finally:
        a.close()
        b.close()


WARNING_KERNEL = "__global__ void noisy(int* out) { int unused; unused = 1; *out = 2; }\n"


def test_a_hit_in_another_folder_replays_warnings_naming_its_own_folder(
    tmp_path: Path, front: Path, toolkit: Toolkit, machine: Machine
) -> None:
    tmp = tmp_path / "dg-cache" / "tmp"
    first, second = (new_folder(tmp, WARNING_KERNEL) for _ in range(2))
    toolkit.reset()
    miss = deepgemm(front, toolkit, machine, first)
    _, said = miss.communicate(timeout=600)
    assert b"warning" in said, said
    assert os.fsencode(str(first)) in said, said
    hit = deepgemm(front, toolkit, machine, second)
    _, replayed = hit.communicate(timeout=600)
    assert hit.returncode == 0
    assert len(toolkit.compiles()) == 1
    assert replayed == said.replace(os.fsencode(str(first)), os.fsencode(str(second)))
