"""On a machine with an NVIDIA GPU: what kernelcache serves loads and runs, with right results.

CI has no GPU, so this is not a test it collects; run it by hand where there is one::

    python tests/gpu_check.py [--keep DIR]

Each check compiles in one process (a miss, compiled for the device's own
architecture), asks again in a fresh process (a hit from the disk tier),
and runs what that hit gave on the GPU against the same computation on the
host:

- ``nvrtc``: :func:`kernelcache.nvrtc.compile` for the three example kernels,
  ``cuModuleLoadData`` of the hit's cubin, ``cuLaunchKernel``;
- ``nvcc``: ``python -m kernelcache nvcc -c`` of a program with host code, the
  object deleted and built again (a launcher hit, byte-identical), linked, run;
- ``triton``: ``TRITON_CACHE_MANAGER=kernelcache.triton:CacheManager``; the
  fresh process launches its kernels without compiling any;
- ``inductor``: ``torch.compile`` on the GPU with that manager; the fresh process
  has empty Inductor and Triton caches of its own, so Inductor writes its Triton
  kernels again, and kernelcache serves every one of them.
- ``inductor-cache``: :func:`kernelcache.inductor.install` (torch.compile's FX
  graph and AOTAutograd caches) with that manager, on whatever torch is installed
  (an untested release installs with a warning when its seams are there): the
  fresh process, with empty Inductor and Triton caches of its own, hits the graph
  in kernelcache and compiles no Triton kernel.

It prints one line per check and exits 1 if any failed. The cubins it loads
were compiled by the device's own toolchain, as a user's would be.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
N = 1 << 20

# A program with host code, as a CMake project would hand the launcher.
APP = r"""
#include <cstdio>
#include <cuda_runtime.h>
#include "common.cuh"

__global__ void scale_add(float* y, const float* x, float a, int n) {
    GRID_STRIDE_LOOP(i, n) { y[i] = a * x[i] + y[i] + (float)i; }
}

int main() {
    const int n = 1 << 20;
    static float hx[1 << 20], hy[1 << 20];
    for (int i = 0; i < n; ++i) { hx[i] = 1.0f; hy[i] = 2.0f; }
    float *x, *y;
    if (cudaMalloc(&x, sizeof hx) != cudaSuccess || cudaMalloc(&y, sizeof hy) != cudaSuccess) return 2;
    cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice);
    cudaMemcpy(y, hy, sizeof hy, cudaMemcpyHostToDevice);
    scale_add<<<256, 256>>>(y, x, 3.0f, n);
    if (cudaMemcpy(hy, y, sizeof hy, cudaMemcpyDeviceToHost) != cudaSuccess) return 3;
    int bad = 0;
    for (int i = 0; i < n; ++i) bad += hy[i] != 5.0f + (float)i;
    printf("mismatches %d of %d\n", bad, n);
    return bad ? 1 : 0;
}
"""

# Triton kernels and the check of their results, run in two processes.
TRITON_PROGRAM = r"""
import json
import torch, triton, triton.language as tl
import kernelcache.triton as kt

@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

@triton.jit
def softmax(out_ptr, in_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * cols + offs, mask=offs < cols, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * cols + offs, e / tl.sum(e, axis=0), mask=offs < cols)

torch.manual_seed(0)
x, y = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
out = torch.empty_like(x)
add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
m = torch.randn(512, 1000, device="cuda")
sm = torch.empty_like(m)
softmax[(512,)](sm, m, 1000, BLOCK=1024)
torch.cuda.synchronize()
ok = torch.equal(out, x + y) and torch.allclose(sm, torch.softmax(m, dim=1), atol=1e-5)
print(json.dumps({"ok": ok, "stats": kt.stats()}))
"""


# torch.compile on the GPU: Inductor writes Triton kernels for the pointwise part and the
# softmax (fused into one, with torch 2.11; the product goes to cuBLAS) and compiles them in
# this process (TORCHINDUCTOR_COMPILE_THREADS=1), through the manager.
INDUCTOR_PROGRAM = r"""
import json
import torch
import kernelcache.triton as kt

def f(x, y):
    return torch.nn.functional.gelu(x @ y) * torch.sin(x) + y.softmax(dim=-1)

torch.manual_seed(0)
x, y = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
out = torch.compile(f)(x, y)
torch.cuda.synchronize()
ok = torch.allclose(out, f(x, y), atol=1e-4, rtol=1e-4)
print(json.dumps({"ok": ok, "stats": kt.stats()}))
"""


# The same function through kernelcache.inductor: torch's graph caches in kernelcache too.
INDUCTOR_CACHE_PROGRAM = r"""
import json
import torch
from torch._dynamo.utils import counters
import kernelcache.inductor as kci
import kernelcache.triton as kt

installed = kci.install()

def f(x, y):
    return torch.nn.functional.gelu(x @ y) * torch.sin(x) + y.softmax(dim=-1)

torch.manual_seed(0)
x, y = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
out = torch.compile(f)(x, y)
torch.cuda.synchronize()
ok = installed and torch.allclose(out, f(x, y), atol=1e-4, rtol=1e-4)
print(json.dumps({"ok": ok, "torch": torch.__version__, "installed": installed,
                  "graphs": dict(counters["inductor"]), "inductor": kci.stats(), "stats": kt.stats()}))
"""


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / "program.py"  # a file: Triton reads a @jit function's source from it
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def device_arch() -> str:
    """``sm_XY`` of CUDA device 0, from the driver."""
    from cuda.bindings import driver as cu

    _ok(cu.cuInit(0))
    dev = _ok(cu.cuDeviceGet(0))
    attr = cu.CUdevice_attribute
    major = _ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = _ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return f"sm_{major}{minor}"


def _ok(result: Any) -> Any:
    """The value of a ``cuda.bindings`` call, or an error naming the failed status."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


# --- NVRTC: compile in one process, hit and run in another -------------------------------


def nvrtc_phase(arch: str) -> dict[str, Any]:
    """Compile the example kernels in the default cache (``KERNELCACHE_DIR``) and run them."""
    from kernelcache import Cache
    from kernelcache.nvrtc import compile as nvrtc_compile

    cache = Cache()
    out: dict[str, Any] = {}
    for name in ("saxpy.cu", "vector_add.cu", "reduction.cu"):
        result = nvrtc_compile(
            (EXAMPLES / name).read_text(), name=name, arch=arch,
            include_dirs=[str(EXAMPLES)], cache=cache,
        )  # fmt: skip
        out[name] = {"hit": result.hit, "bytes": len(result.binary), "key": result.key}
        out[name]["mismatches"], out[name]["max_error"] = run_nvrtc_kernel(name, result.binary)
    return out


def run_nvrtc_kernel(name: str, cubin: bytes) -> tuple[int, float]:
    """Load ``cubin`` with ``cuModuleLoadData``, launch its kernel: ``(wrong outputs, largest error)``."""
    import numpy as np
    from cuda.bindings import driver as cu

    _ok(cu.cuInit(0))
    ctx = _ok(cu.cuDevicePrimaryCtxRetain(_ok(cu.cuDeviceGet(0))))
    _ok(cu.cuCtxSetCurrent(ctx))
    module = _ok(cu.cuModuleLoadData(cubin))
    rng = np.random.default_rng(0)
    a = rng.standard_normal(N, dtype=np.float32)
    b = rng.standard_normal(N, dtype=np.float32)
    buffers: list[Any] = []

    def device(array: Any) -> Any:
        ptr = _ok(cu.cuMemAlloc(array.nbytes))
        _ok(cu.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes))
        buffers.append(ptr)
        return ptr

    def launch(kernel: bytes, *args: Any) -> None:
        # cuLaunchKernel takes an array of pointers to each argument's value.
        values = [
            np.array([int(a)], np.uint64) if isinstance(a, cu.CUdeviceptr) else a for a in args
        ]
        pointers = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        fn = _ok(cu.cuModuleGetFunction(module, kernel))
        _ok(cu.cuLaunchKernel(fn, 256, 1, 1, 256, 1, 1, 0, cu.CUstream(0), pointers.ctypes.data, 0))
        _ok(cu.cuCtxSynchronize())

    n = np.array([N], np.int32)
    if name == "saxpy.cu":
        y = device(b)
        launch(b"saxpy", np.array([2.5], np.float32), device(a), y, n)
        got, want = np.empty_like(b), np.float32(2.5) * a + b
    elif name == "vector_add.cu":
        c = device(np.zeros_like(a))
        launch(b"vector_add", device(a), device(b), c, n)
        got, want, y = np.empty_like(a), a + b, c
    else:
        y = device(np.zeros(1, np.float32))
        launch(b"reduce_sum", device(a), y, n)
        got, want = np.empty(1, np.float32), np.array([a.sum(dtype=np.float64)], np.float32)
    _ok(cu.cuMemcpyDtoH(got.ctypes.data, y, got.nbytes))
    for ptr in buffers:
        _ok(cu.cuMemFree(ptr))
    _ok(cu.cuModuleUnload(module))
    # saxpy's fused multiply-add rounds once where NumPy rounds twice (an ulp apart, which
    # near a cancellation is no small relative error); the sum of 2^20 values in float32, in
    # the GPU's order, is a few ulps of its partial sums (~1e-3 at ~1000) from the float64 sum.
    atol = 1e-2 if name == "reduction.cu" else 1e-6
    wrong = np.count_nonzero(~np.isclose(got, want, rtol=1e-6, atol=atol))
    return int(wrong), float(np.max(np.abs(got - want)))


def check_nvrtc(work: Path, arch: str) -> tuple[bool, str]:
    here = str(Path(__file__).parent)
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import gpu_check as g; "
        f"print(json.dumps(g.nvrtc_phase({arch!r})))"
    )
    runs = []
    for _ in range(2):  # a miss, then a fresh process's disk hit
        done = _python(code, _env(KERNELCACHE_DIR=str(work / "nvrtc-cache")), work)
        if done.returncode != 0:
            return False, f"process failed: {done.stderr.strip()[-800:]}"
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    good = all(
        not cold[k]["hit"] and warm[k]["hit"] and cold[k]["key"] == warm[k]["key"]
        and cold[k]["mismatches"] == 0 and warm[k]["mismatches"] == 0
        for k in cold
    )  # fmt: skip
    return good, json.dumps({"first": cold, "fresh process": warm})


# --- nvcc launcher: a program with host code, built, deleted, built again, run -------------


def check_nvcc(work: Path, arch: str) -> tuple[bool, str]:
    app = work / "app"
    app.mkdir()
    (app / "app.cu").write_text(APP)
    env = _env(KERNELCACHE_DIR=str(work / "nvcc-cache"))
    compile_cmd = [sys.executable, "-m", "kernelcache", "nvcc", f"-arch={arch}",
                   f"-I{EXAMPLES}", "-c", "app.cu", "-o", "app.o"]  # fmt: skip
    objects, outputs = [], []
    for _ in range(2):
        (app / "app.o").unlink(missing_ok=True)
        built = subprocess.run(compile_cmd, cwd=app, env=env, capture_output=True, text=True)
        if built.returncode != 0:
            return False, f"kernelcache nvcc failed: {built.stderr[-800:]}"
        objects.append((app / "app.o").read_bytes())
        link = subprocess.run(["nvcc", f"-arch={arch}", "app.o", "-o", "app"], cwd=app,
                              capture_output=True, text=True)  # fmt: skip
        if link.returncode != 0:
            return False, f"link failed: {link.stderr[-800:]}"
        ran = subprocess.run(["./app"], cwd=app, capture_output=True, text=True, timeout=120)
        outputs.append((ran.returncode, ran.stdout.strip()))
    stats = subprocess.run([sys.executable, "-m", "kernelcache", "stats", "--json"], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    launcher = json.loads(stats.stdout)["nvcc_launcher"]
    good = (
        objects[0] == objects[1]
        and all(code == 0 for code, _ in outputs)
        and launcher.get("misses") == 1
        and launcher.get("hits") == 1
    )
    return good, json.dumps({"runs": outputs, "same object": objects[0] == objects[1],
                             "launcher": launcher})  # fmt: skip


# --- Triton: its cache manager; the fresh process launches without compiling ---------------


def _twice(program: str, work: Path, envs: list[dict[str, str]]) -> list[dict[str, Any]] | str:
    """``program``'s JSON report from a first process and a fresh one; a string if one failed."""
    reports = []
    for env in envs:
        done = _python(program, env, work)
        if done.returncode != 0:
            return f"process failed: {done.stderr.strip()[-800:]}"
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return reports


def _served(cold: dict[str, Any], warm: dict[str, Any], groups: int) -> bool:
    """Both right; the first published ``groups`` or more, the fresh one hit and published none."""
    first, fresh = cold["stats"]["triton"], warm["stats"]["triton"]
    return bool(
        cold["ok"] and warm["ok"]
        and first["groups_published"] >= groups
        and fresh["group_hits"] >= groups
        and fresh["group_misses"] == 0
        and fresh["groups_published"] == 0
    )  # fmt: skip


def _triton_env(work: Path, **extra: str) -> dict[str, str]:
    extra.setdefault("KERNELCACHE_DIR", str(work / "kc"))
    return _env(TRITON_CACHE_MANAGER="kernelcache.triton:CacheManager", **extra)


def check_triton(work: Path) -> tuple[bool, str]:
    env = _triton_env(
        work, KERNELCACHE_TRITON_DIR=str(work / "triton-kc"), TRITON_CACHE_DIR=str(work / "triton")
    )
    runs = _twice(TRITON_PROGRAM, work, [env, env])
    if isinstance(runs, str):
        return False, runs
    cold, warm = runs
    return _served(cold, warm, groups=2), json.dumps({"first": cold, "fresh process": warm})


def check_inductor(work: Path) -> tuple[bool, str]:
    # Each process gets empty caches of Inductor's and Triton's own: only kernelcache can hit.
    envs = [
        _triton_env(
            work,
            KERNELCACHE_TRITON_DIR=str(work / "inductor-kc"),
            TRITON_CACHE_DIR=str(work / f"inductor-triton-{run}"),
            TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{run}"),
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        for run in range(2)
    ]
    runs = _twice(INDUCTOR_PROGRAM, work, envs)
    if isinstance(runs, str):
        return False, runs
    cold, warm = runs
    return _served(cold, warm, groups=1), json.dumps({"first": cold, "fresh process": warm})


def check_inductor_cache(work: Path) -> tuple[bool, str]:
    # Two machines: a kernelcache directory in common, nothing else (Inductor's and Triton's
    # own caches empty in each).
    envs = [
        _triton_env(
            work,
            KERNELCACHE_DIR=str(work / "graphs-kc"),
            KERNELCACHE_TRITON_DIR=str(work / "graphs-triton-kc"),
            TRITON_CACHE_DIR=str(work / f"graphs-triton-{run}"),
            TORCHINDUCTOR_CACHE_DIR=str(work / f"graphs-inductor-{run}"),
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        for run in range(2)
    ]
    runs = _twice(INDUCTOR_CACHE_PROGRAM, work, envs)
    if isinstance(runs, str):
        return False, runs
    cold, warm = runs
    good = bool(
        cold["ok"] and warm["ok"]
        and cold["graphs"].get("fxgraph_cache_miss", 0) >= 1
        and cold["inductor"]["puts"] >= 1
        and warm["graphs"].get("fxgraph_cache_hit", 0) >= 1
        and warm["graphs"].get("fxgraph_cache_miss", 0) == 0
        and warm["inductor"]["hits"] >= 1
        and warm["stats"]["triton"]["group_misses"] == 0
    )  # fmt: skip
    return good, json.dumps({"first": cold, "fresh process": warm})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep", help="work in this directory and keep it (default: a temporary one)"
    )
    parser.add_argument(
        "--only", choices=["nvrtc", "nvcc", "triton", "inductor", "inductor-cache"], action="append"
    )
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="kernelcache-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    arch = device_arch()
    print(f"device 0: {arch}; work in {work}", flush=True)
    checks: dict[str, Callable[[], tuple[bool, str]]] = {
        "nvrtc": lambda: check_nvrtc(work, arch),
        "nvcc": lambda: check_nvcc(work, arch),
        "triton": lambda: check_triton(work),
        "inductor": lambda: check_inductor(work),
        "inductor-cache": lambda: check_inductor_cache(work),
    }
    failed = 0
    for name, check in checks.items():
        if args.only and name not in args.only:
            continue
        good, detail = check()
        failed += not good
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
