"""TileLang kernels compiled by the TileLang tests and benchmarks, in a process of their own.

Run as ``python tilelang_kernels.py KERNEL BACKEND [options]`` it compiles one
kernel and prints one JSON line: the integration's counters, the kernel
object's class and its adapter's, and the seconds the compile took. Options:
``--upstream`` (TileLang's own cache, kernelcache not installed),
``--wait-for PATH`` (after imports, create ``PATH.ready.<pid>`` and wait for
PATH: lets a test start several compiles at the same moment), and
``--variant`` (another kernel of the same kind: the add's block size, the
GEMM's k tile), ``--n N`` (the add kernel for N elements: another
launch grid, the same device code), ``--sweep FIRST:COUNT`` (COUNT add kernels one after another, each with a block
size and element type of its own: an autotuning sweep's new kernels), ``--evict-after-get`` (remove the entry and its files from the cache between
kernelcache's lookup and the load: another process's eviction, injected), ``--first-run``
(take the first-run path, kernelcache.tilelang.firstrun, as if the key's fields were still
being derived), ``--record-fresh`` (a hit by the walk records the header manifest even for an
entry compiled within the last minute), ``--lookup-fails`` (the key's derivation raises PermissionError) and ``--publish-gate PATH`` (the
entry is packed only once PATH exists; when the compile call returns, ``PATH.returned`` says how
many entries the cache directory held then).
The GPU-free targets name an architecture (the bare "cuda" target means sm_50).
"""

# No "from __future__ import annotations": TileLang evaluates the annotations of prim_funcs.

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import children

_STARTED = time.perf_counter()
import tilelang  # noqa: E402 (timed: the import every fresh process pays)
import tilelang.language as T  # noqa: E402

TOOL_IMPORT_S = time.perf_counter() - _STARTED

ADD_TARGET = {"kind": "cuda", "arch": "sm_90"}
GEMM_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def add(n: int = 1024, block: int = 128, dtype: str = "float32") -> Any:
    @T.prim_func
    def main(A: T.Tensor((n,), dtype), B: T.Tensor((n,), dtype), C: T.Tensor((n,), dtype)) -> None:
        with T.Kernel(T.ceildiv(n, block), threads=block) as bx:
            for i in T.Parallel(block):
                C[bx * block + i] = A[bx * block + i] + B[bx * block + i]

    return main


def gemm(m: int = 256, n: int = 256, k: int = 256, bm: int = 64, bn: int = 64, bk: int = 32) -> Any:
    dtype, accum = "float16", "float32"

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype)
    ) -> None:
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=128) as (bx, by):
            a_shared = T.alloc_shared((bm, bk), dtype)
            b_shared = T.alloc_shared((bk, bn), dtype)
            c_local = T.alloc_fragment((bm, bn), accum)
            T.clear(c_local)
            for ko in T.Pipelined(T.ceildiv(k, bk), num_stages=2):
                T.copy(A[by * bm, ko * bk], a_shared)
                T.copy(B[ko * bk, bx * bn], b_shared)
                T.gemm(a_shared, b_shared, c_local)
            T.copy(c_local, C[by * bm, bx * bn])

    return main


#: ``--variant``: the same kernel with another tile size (new code, same toolchain).
VARIANTS: dict[str, dict[str, int]] = {"add": {"block": 64}, "gemm": {"bk": 64}}

KERNELS: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {
    "add": (add, ADD_TARGET),
    "gemm": (gemm, GEMM_TARGET),
}


_SWEEP_DTYPES = ("float32", "int32", "float16")


def _sweep_config(name: str, index: int) -> dict[str, Any]:
    """The add kernel of an autotuning-like sweep: a block size and element type of its
    own, so its device code differs (a size that only changes the grid gives the same code)."""
    if name != "add" or not 0 <= index < 32 * len(_SWEEP_DTYPES):
        raise SystemExit(
            f"--sweep: add kernels 0..{32 * len(_SWEEP_DTYPES) - 1}, not {name} {index}"
        )
    block = 32 * (1 + index % 32)
    return {"block": block, "n": 8 * block, "dtype": _SWEEP_DTYPES[index // 32]}


def compile_kernel(name: str, backend: str, **params: Any) -> Any:
    make, target = KERNELS[name]
    return tilelang.compile(make(**params), out_idx=[2], target=target, execution_backend=backend)


def _evict_after_get() -> None:
    import kernelcache.tilelang
    import kernelcache.tilelang.kernels as kernels

    real_load = kernels.load

    def load(entry: Any, call: dict[str, Any]) -> Any:
        cache = kernelcache.tilelang.get_cache()
        for key in list(cache.tiers[-1].keys()):
            cache.delete(key)
        return real_load(entry, call)

    kernels.load = load


def _gate_publish(gate: Path) -> None:
    import kernelcache.tilelang.kernels as kernels

    real_pack = kernels.pack

    def pack(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + 300
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_pack(*args, **kwargs)

    kernels.pack = pack


def main(argv: list[str]) -> None:
    name, backend = argv[0], argv[1]
    use_kernelcache = "--upstream" not in argv
    imported = time.perf_counter()
    if use_kernelcache:
        import kernelcache.tilelang

        kernelcache.tilelang.install()
    import_s = time.perf_counter() - imported
    if use_kernelcache:
        if "--evict-after-get" in argv:
            _evict_after_get()
        if "--record-fresh" in argv:
            from kernelcache.tilelang import recording

            recording.FRESH_NS = 0  # record a manifest after a walk's hit on a new entry too
        if "--first-run" in argv:
            from kernelcache.tilelang import keys

            keys.settled = lambda: False
        if "--publish-gate" in argv:
            _gate_publish(Path(argv[argv.index("--publish-gate") + 1]))
        if "--lookup-fails" in argv:
            import kernelcache.tilelang.kernels as kernels

            def fails(backend: str) -> Any:
                raise PermissionError("planted: the header trees are unreadable")

            setattr(kernels, "shared_fields", fails)  # noqa: B010 (a name imported there)
    if "--wait-for" in argv:
        children.wait_for(argv[argv.index("--wait-for") + 1])
    params: dict[str, Any] = dict(VARIANTS[name]) if "--variant" in argv else {}
    if "--n" in argv:  # the add kernel of another size: the grid changes, the device code not
        params["n"] = int(argv[argv.index("--n") + 1])
    configs = [params]
    if "--sweep" in argv:
        first, count = map(int, argv[argv.index("--sweep") + 1].split(":"))
        configs = [_sweep_config(name, first + i) for i in range(count)]
    start, cpu = time.perf_counter(), children.cpu_seconds()
    for config in configs:
        kernel = compile_kernel(name, backend, **config)
    seconds, cpu = time.perf_counter() - start, children.cpu_seconds() - cpu
    if "--publish-gate" in argv:
        from kernelcache.stores.disk import DiskStore

        # Files and packed records alike (stores/disk/pack.py).
        entries = list(DiskStore(os.environ["KERNELCACHE_DIR"], read_only=True).keys())
        gate = argv[argv.index("--publish-gate") + 1]
        Path(gate + ".part").write_text(json.dumps({"entries": len(entries)}))
        os.replace(gate + ".part", gate + ".returned")  # whole when the test sees it
    report = {
        "seconds": seconds,
        "cpu_s": cpu,
        # Outside the compile call, paid once per process: TileLang's import, and
        # kernelcache's import and install() (0 for --upstream).
        "tool_import_s": TOOL_IMPORT_S,
        "import_s": import_s,
        "kernel_class": f"{type(kernel).__module__}.{type(kernel).__qualname__}",
        "adapter_class": f"{type(kernel.adapter).__module__}.{type(kernel.adapter).__qualname__}",
        "source_chars": len(kernel.get_kernel_source() or ""),
    }
    if use_kernelcache:
        import kernelcache.tilelang
        from kernelcache.tilelang import recording

        # The header manifest is recorded after the kernel is handed back: its CPU, apart.
        cpu = children.cpu_seconds()
        recording.wait()
        report["manifest_cpu_s"] = children.cpu_seconds() - cpu
        report["stats"] = kernelcache.tilelang.stats()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
