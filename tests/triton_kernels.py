"""Real Triton kernels compiled ahead of time by the Triton tests and benchmarks.

Run as a script it compiles the named kernels through whatever manager the
environment selects (``TRITON_CACHE_MANAGER``) and prints one JSON report:
per kernel, whether Triton's compilation listener saw a cache hit, which
lowering stages ran, and the SHA-256 of every file in the group.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    num = tl.exp(x)
    tl.store(out_ptr + row * out_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        acc += tl.dot(tl.load(a), tl.load(b))
        a += BK * stride_ak
        b += BK * stride_bk
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(tl.float16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _sources(block: int = 1024) -> dict[str, Any]:
    ASTSource = triton.compiler.ASTSource
    ptr32, i32 = "*fp32", "i32"
    return {
        "add": ASTSource(
            add_kernel,
            signature={"x_ptr": ptr32, "y_ptr": ptr32, "out_ptr": ptr32, "n": i32,
                       "BLOCK": "constexpr"},
            constexprs={"BLOCK": block},
        ),
        "softmax": ASTSource(
            softmax_kernel,
            signature={"out_ptr": ptr32, "in_ptr": ptr32, "in_stride": i32, "out_stride": i32,
                       "n_cols": i32, "BLOCK": "constexpr"},
            constexprs={"BLOCK": 256},
        ),
        "matmul": ASTSource(
            matmul_kernel,
            signature={**{p: "*fp16" for p in ("a_ptr", "b_ptr", "c_ptr")},
                       **{s: i32 for s in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk",
                                           "stride_bn", "stride_cm", "stride_cn")},
                       "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
            constexprs={"BM": 64, "BN": 64, "BK": 32},
        ),
    }  # fmt: skip


def source(name: str, block: int = 1024) -> Any:
    """The ASTSource of kernel ``name`` (``add``, ``softmax`` or ``matmul``)."""
    return _sources(block)[name]


def compile_kernel(
    name: str, block: int = 1024, options: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """Compile one kernel for sm_90 (with Triton ``options``, such as ``num_warps``);
    returns the kernel and what the listener saw."""
    seen: dict[str, Any] = {}

    def listener(
        *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool
    ) -> None:
        seen["cache_hit"] = cache_hit
        seen["stages"] = [stage for stage, _ in times.lowering_stages]
        seen["group"] = dict(metadata_group)

    triton.knobs.compilation.listener = listener
    try:
        start = time.perf_counter()
        kernel = triton.compile(source(name, block), target=TARGET, options=options)
        seen["seconds"] = time.perf_counter() - start
    finally:
        triton.knobs.compilation.listener = None
    if not hasattr(kernel, "metadata_group"):  # Triton 3.4 keeps it only for the listener
        kernel.metadata_group = seen["group"]
    del seen["group"]
    return kernel, seen


def report(kernel: Any, seen: dict[str, Any]) -> dict[str, Any]:
    files = {}
    for child, path in kernel.metadata_group.items():
        with open(path, "rb") as f:
            files[child] = hashlib.sha256(f.read()).hexdigest()
    return {**seen, "hash": kernel.hash, "files": files, "paths": kernel.metadata_group}


def main(argv: list[str]) -> int:
    # Concurrent runs wait for a start file so that their compiles overlap.
    start_file = os.environ.get("KC_TEST_START_FILE")
    if start_file:
        deadline = time.monotonic() + 60
        while not os.path.exists(start_file) and time.monotonic() < deadline:
            time.sleep(0.01)
    options = json.loads(os.environ.get("KC_TEST_TRITON_OPTIONS", "{}"))
    out = {}
    for name in argv:
        out[name] = report(*compile_kernel(name, options=options))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
