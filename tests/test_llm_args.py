"""The command lines LLM servers' JIT builds pass the nvcc launcher (issue 37), parsed.

FlashInfer's ninja rule, DeepGEMM's compile and torch's ``cpp_extension`` rule, as
those libraries write them: each is cacheable, keyed by meaning (two spellings of
one option share a key; an option that cannot change the output is not keyed),
and what stays uncacheable says why.
"""

from __future__ import annotations

import pytest

from kernelcache.nvcc import args as nvcc_args

#: FlashInfer 0.7.2's ``cuda_compile`` rule, expanded as ninja runs it.
FLASHINFER = [
    "--generate-dependencies-with-compile",
    "-MF",
    "act.cuda.o.d",
    "-DTVM_FFI_DLL_EXPORT_INCLUDE_METADATA",
    "-isystem",
    "/site/tvm_ffi/include",
    "-I/ws/generated",
    "--compiler-options=-fPIC",
    "--expt-relaxed-constexpr",
    "-static-global-template-stub=false",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-DFLASHINFER_ENABLE_FP8_E4M3",
    "--threads=1",
    "-use_fast_math",
    "-Xfatbin=-compress-all",
    "--compress-mode=size",
    "-std=c++17",
    "-O3",
    "-c",
    "/site/flashinfer/data/csrc/act.cu",
    "-o",
    "act.cuda.o",
]
#: DeepGEMM's JIT compile (``<compiler> <dir>/kernel.cu -cubin -o <dir>/kernel.cubin <flags>``).
DEEPGEMM = [
    "/c/tmp/0f1e/kernel.cu",
    "-cubin",
    "-o",
    "/c/tmp/0f1e/kernel.cubin",
    "-std=c++20",
    "--diag-suppress=39,161,174,177,186,940",
    "--ptxas-options=--register-usage-level=10",
    "-I/site/deep_gemm/include",
    "-O3",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-gencode=arch=compute_90a,code=sm_90a",
]
#: torch.utils.cpp_extension's ``cuda_compile`` rule (``-MD -MF`` through its long names).
TORCH = [
    "--generate-dependencies-with-compile",
    "--dependency-output",
    "ext.cuda.o.d",
    "-DTORCH_EXTENSION_NAME=ext",
    "-isystem",
    "/site/torch/include",
    "-isystem",
    "/usr/include/python3.11",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "--expt-relaxed-constexpr",
    "-gencode=arch=compute_90,code=compute_90",
    "-gencode=arch=compute_90,code=sm_90",
    "--compiler-options",
    "'-fPIC'",
    "-std=c++17",
    "-c",
    "/b/ext/cuda.cu",
    "-o",
    "cuda.cuda.o",
]


@pytest.mark.parametrize(
    ("argv", "depfile"),
    [
        pytest.param(FLASHINFER, "act.cuda.o.d", id="flashinfer"),
        pytest.param(DEEPGEMM, None, id="deepgemm"),
        pytest.param(TORCH, "ext.cuda.o.d", id="torch-cpp-extension"),
        pytest.param(["-Xptxas", "-v", "-Xfatbin", "-compress-all", "-c", "k.cu"], None, id="X"),
    ],
)
def test_llm_jit_command_lines_are_cacheable(argv: list[str], depfile: str | None) -> None:
    inv = nvcc_args.parse(argv, environ={})
    assert inv.reason is None
    assert inv.depfile == depfile
    assert (inv.depmode is not None) == (depfile is not None)


def keyed(argv: list[str]) -> list[list[str | None]]:
    inv = nvcc_args.parse(argv, environ={})
    assert inv.reason is None, inv.reason
    return inv.keyed


SAME_KEY = [
    pytest.param(["-Xfatbin=-compress-all"], ["--fatbin-options", "-compress-all"], id="Xfatbin"),
    pytest.param(["-Xptxas", "-v"], ["--ptxas-options=-v"], id="Xptxas"),
    pytest.param(["--threads=1"], ["-t", "8"], id="threads-not-keyed"),
    pytest.param(["--threads=4"], [], id="threads-absent"),
    pytest.param(["-use_fast_math"], ["--use_fast_math"], id="fast-math"),
    pytest.param(["--compress-mode=size"], ["-compress-mode", "size"], id="compress-mode"),
    pytest.param(
        ["-MD", "-MF", "a.d"], ["--generate-dependencies-with-compile", "-MF", "b.d"], id="md"
    ),
    pytest.param(["-isystem", "/i"], ["--system-include=/i"], id="isystem"),
]
DIFFERENT_KEY = [
    pytest.param(["-Xfatbin=-compress-all"], [], id="Xfatbin"),
    pytest.param(["-Xptxas", "-O1"], ["-Xptxas", "-O3"], id="Xptxas"),
    pytest.param(["--compress-mode=size"], ["--compress-mode=speed"], id="compress-mode"),
    pytest.param(["-static-global-template-stub=false"], [], id="template-stub"),
    pytest.param(["-use_fast_math"], [], id="fast-math"),
    pytest.param(["-isystem", "/i"], ["-I/i"], id="isystem-vs-I"),
    pytest.param(
        ["-gencode=arch=compute_90a,code=sm_90a"],
        ["-gencode=arch=compute_90,code=sm_90"],
        id="arch",
    ),
]


@pytest.mark.parametrize(("a", "b"), SAME_KEY)
def test_spellings_with_one_meaning_share_a_key(a: list[str], b: list[str]) -> None:
    assert keyed([*a, "-c", "k.cu"]) == keyed([*b, "-c", "k.cu"])


@pytest.mark.parametrize(("a", "b"), DIFFERENT_KEY)
def test_options_that_change_the_output_are_keyed(a: list[str], b: list[str]) -> None:
    assert keyed([*a, "-c", "k.cu"]) != keyed([*b, "-c", "k.cu"])


def test_threads_is_checked_by_nvcc_not_the_key() -> None:
    """``--threads`` takes a value: one missing it is refused like any option's."""
    inv = nvcc_args.parse(["-c", "k.cu", "--threads"], environ={})
    assert inv.reason == "option --threads is missing its value"


@pytest.mark.parametrize(
    ("source", "folder"),
    [
        pytest.param("/cache/tmp/u1/kernel.cu", "/cache/tmp/u1", id="normal"),
        pytest.param("/cache/tmp/x/../u1/kernel.cu", None, id="dot-dot"),
        pytest.param("/cache//tmp/u1/kernel.cu", None, id="double-slash"),
        pytest.param("kernel.cu", None, id="relative"),
    ],
)
def test_only_a_normally_spelled_source_path_leaves_its_folder_out(
    source: str, folder: str | None
) -> None:
    # __FILE__ is the path as written; the output is searched for the folder's normal
    # spelling, so another spelling could hide a named folder and be served elsewhere.
    from kernelcache.nvcc import key

    inv = nvcc_args.parse(["-cubin", "-arch=sm_90", source, "-o", "k.cubin"], environ={})
    assert key.portable_folder(inv, {}) == folder
