"""The real FlashInfer JIT and torch's ``load_inline`` through the launcher (issue 37).

Machine A (its own cache directory) builds with the launcher and the team's Redis;
machine B (a fresh cache directory, the same Redis, the same paths) builds the
same module again: no nvcc compile runs, and the module is produced (FlashInfer's
``.so``) or imports (torch's extension). Compiles are real, through the stand-in
toolkit whose nvcc counts its runs; no GPU is needed (FlashInfer builds for
``FLASHINFER_CUDA_ARCH_LIST=9.0a``; its link's ``-lcuda`` finds a stub in
``lib64/stubs``).

They need FlashInfer 0.7.2 beside a CUDA build of torch: the ``torch 2.15.0``
matrix cell (scripts/matrix.cells) installs them; elsewhere they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cuda_standin import Toolkit, build_libcuda_stub, make_toolkit
from launcher_env import clean_env, make_bin, stop_server
from redis_server import LOADED, RedisServer, unique_namespace


def _cuda_torch() -> bool:
    """Whether torch here is a CUDA build, read from its version file (importing torch
    at collection would cost every test run seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        lines = version.read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith("cuda") and "None" not in line for line in lines)


def _flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


pytestmark = [
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH"),
    pytest.mark.skipif(
        not _cuda_torch(), reason="needs a CUDA build of torch (the torch 2.15.0 matrix cell)"
    ),
    pytest.mark.slow,
    # A cold torch extension is two compiles against torch's headers: minutes on 2 cores.
    pytest.mark.timeout(1800),
]

FLASHINFER_BUILD = """
from flashinfer.jit.activation import gen_act_and_mul_module
spec = gen_act_and_mul_module("silu")
spec.build()
print(spec.get_library_path())
"""
TORCH_BUILD = """
import torch.utils.cpp_extension as ext
cuda = '''
#include <torch/extension.h>
__global__ void twice_kernel(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2.0f;
}
torch::Tensor twice(torch::Tensor x) {
    twice_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), x.numel());
    return x;
}
'''
module = ext.load_inline(
    "kc_twice", cpp_sources="torch::Tensor twice(torch::Tensor x);", cuda_sources=cuda,
    functions=["twice"], verbose=False,
)
print(module.twice.__doc__ is not None and "imported")
"""


def toolkit_with_stubs(root: Path) -> Toolkit:
    """The counting toolkit, with ``lib64/stubs/libcuda.so`` (FlashInfer links ``-lcuda``)."""
    kit = make_toolkit(root, libcuda_stub=False)
    lib64 = kit.root / "lib64"
    real = lib64.resolve()
    lib64.unlink()
    lib64.mkdir()
    for item in real.iterdir():
        if item.name != "stubs":
            (lib64 / item.name).symlink_to(item)
    build_libcuda_stub(lib64 / "stubs")
    return kit


def compiles(kit: Toolkit) -> list[str]:
    """nvcc runs that compiled an object (not the link, probes or dry runs)."""
    return [args for args in kit.compiles() if "-c" in args.split()]


def build(script: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def machines(
    tmp_path: Path, redis_server: RedisServer
) -> Iterator[tuple[Toolkit, dict[str, str], dict[str, str]]]:
    kit = toolkit_with_stubs(tmp_path / "toolkit")
    front = make_bin(tmp_path / "bin")
    remote = f"{redis_server.url}?namespace={unique_namespace()}&timeout={LOADED:g}"
    a, b = (kit.env(clean_env(tmp_path / name, KERNELCACHE_REMOTE=remote)) for name in ("a", "b"))
    for env in (a, b):
        env["CUDA_HOME"] = str(kit.root)
        env["FLASHINFER_NVCC_LAUNCHER"] = str(front)
        env["PYTORCH_NVCC"] = f"{front} {kit.root / 'bin' / 'nvcc'}"
        env["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
        env["FLASHINFER_WORKSPACE_BASE"] = str(tmp_path / "ws")
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
        env["MAX_JOBS"] = "2"
    yield kit, a, b
    for name in ("a", "b"):
        stop_server(tmp_path / name)


@pytest.mark.skipif(not _flashinfer(), reason="needs flashinfer-python (torch 2.15.0 matrix cell)")
def test_real_flashinfer_module_on_a_second_machine_runs_no_nvcc(
    tmp_path: Path, machines: tuple[Toolkit, dict[str, str], dict[str, str]]
) -> None:
    kit, a, b = machines
    library = Path(build(FLASHINFER_BUILD, a))
    assert library.is_file()
    assert len(compiles(kit)) == 1, kit.compiles()
    shutil.rmtree(tmp_path / "ws")  # machine B: a fresh workspace at the same path
    assert Path(build(FLASHINFER_BUILD, b)) == library
    assert library.is_file()
    assert len(compiles(kit)) == 1, kit.compiles()


def test_torch_load_inline_on_a_second_machine_runs_no_nvcc(
    tmp_path: Path, machines: tuple[Toolkit, dict[str, str], dict[str, str]]
) -> None:
    kit, a, b = machines
    assert build(TORCH_BUILD, a) == "imported"
    assert len(compiles(kit)) == 1, kit.compiles()
    shutil.rmtree(tmp_path / "ext")
    assert build(TORCH_BUILD, b) == "imported"
    assert len(compiles(kit)) == 1, kit.compiles()
    assert os.listdir(tmp_path / "ext")
