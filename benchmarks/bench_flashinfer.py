"""FlashInfer's real JIT through the launcher: a cold build against a second machine's (issue 37).

Runs ``flashinfer.jit.activation.gen_act_and_mul_module("silu").build()`` with
``FLASHINFER_CUDA_ARCH_LIST=9.0a`` (no GPU needed) in a Python that has
FlashInfer 0.7.2 beside a CUDA build of torch, three times (after one untimed
build that warms the page cache), each in a fresh FlashInfer workspace at the same path:

1. no launcher (FlashInfer alone);
2. ``FLASHINFER_NVCC_LAUNCHER=kernelcache`` with an empty cache (machine A);
3. the same with a fresh cache directory sharing A's Redis, or A's directory
   when no ``--remote`` is given (machine B).

It prints each wall time and the ratios. Its link passes ``-lcuda``: a toolkit
folder with a stub ``lib64/stubs/libcuda.so`` (made with gcc) stands in.

    python benchmarks/bench_flashinfer.py --python ~/.cache/kernelcache-matrix/torch-2.15.0/bin/python
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results

BUILD = 'from flashinfer.jit.activation import gen_act_and_mul_module\ngen_act_and_mul_module("silu").build()\n'


def toolkit(where: Path, real: Path) -> Path:
    """``real`` CUDA with a stub libcuda in ``lib64/stubs`` (every other entry a link)."""
    root = where / "cuda"
    (root / "lib64" / "stubs").mkdir(parents=True)
    for item in real.iterdir():
        if item.name != "lib64":
            (root / item.name).symlink_to(item)
    for item in (real / "lib64").iterdir():
        if item.name != "stubs":
            (root / "lib64" / item.name).symlink_to(item)
    stub = root / "lib64" / "stubs" / "libcuda.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(stub), "-x", "c", "-"],
        input=b"int cuInit(int flags) { return 100; }\n",
        check=True,
    )
    return root


def build(python: str, env: dict[str, str], workspace: Path) -> float:
    shutil.rmtree(workspace, ignore_errors=True)
    began = time.perf_counter()
    subprocess.run([python, "-c", BUILD], env=env, check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True, help="a Python with flashinfer and CUDA torch")
    parser.add_argument("--cuda", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    parser.add_argument("--remote", help="KERNELCACHE_REMOTE shared by the two machines")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    started = results.machine()
    launcher = shutil.which("kernelcache") or str(Path(sys.executable).parent / "kernelcache")
    with tempfile.TemporaryDirectory(prefix="bench-flashinfer-") as scratch:
        root = Path(scratch)
        workspace = root / "ws"
        base = {
            **os.environ,
            "CUDA_HOME": str(toolkit(root, Path(args.cuda).resolve())),
            "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
            "FLASHINFER_WORKSPACE_BASE": str(workspace),
        }
        build(args.python, base, workspace)  # untimed: the first build warms the page cache
        alone = build(args.python, base, workspace)
        cached = {**base, "FLASHINFER_NVCC_LAUNCHER": launcher}
        if args.remote:
            cached["KERNELCACHE_REMOTE"] = args.remote
        cold = build(args.python, {**cached, "KERNELCACHE_DIR": str(root / "a")}, workspace)
        second = str(root / ("b" if args.remote else "a"))
        warm = build(args.python, {**cached, "KERNELCACHE_DIR": second}, workspace)
    print(f"flashinfer alone        {alone:8.1f} s")
    print(f"kernelcache, machine A  {cold:8.1f} s  ({cold / alone:.2f}x alone)")
    print(f"kernelcache, machine B  {warm:8.1f} s  ({alone / warm:.1f}x faster than alone)")
    second = "a fresh cache directory sharing A's Redis" if args.remote else "A's cache directory"
    targets = [
        results.target(
            "a cold build through the launcher within 1.05× of FlashInfer alone",
            f"{cold:.1f} / {alone:.1f} s",
            cold <= 1.05 * alone,
            ratio=f"{cold / alone:.2f}×",
        ),
        results.target(
            f"machine B ({second}) faster than FlashInfer alone",
            f"{warm:.1f} / {alone:.1f} s",
            warm < alone,
            ratio=f"{alone / warm:.1f}× faster",
        ),
    ]
    details = {"alone_s": alone, "machine_a_s": cold, "machine_b_s": warm}
    contenders = ["FlashInfer 0.7.2 JIT alone", "FLASHINFER_NVCC_LAUNCHER=kernelcache"]
    doc = results.document(
        "bench_flashinfer", contenders=contenders, targets=targets, details=details, started=started
    )
    results.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
