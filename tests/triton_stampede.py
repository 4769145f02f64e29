"""A process compiling Triton kernel variants, counting the compiles that really ran.

Run by tests/test_triton_flight.py and benchmarks/bench_triton.py as
``python triton_stampede.py JSON``; the environment selects the manager
(``TRITON_CACHE_MANAGER``) and the cache. Options:

    variants     the variants of ``scale_kernel`` to compile, in order
    barrier      a directory: wait until ``parties`` processes have arrived there
    parties      how many processes the barrier waits for
    ready        a file created once imported and warmed up (before the barrier)
    warm         compile a kernel of this process's own first (before the barrier), so
                 that Triton's one-time start-up in a process is not measured
    fork         compile in this many ``multiprocessing`` workers forked from this
                 process (they leave through os._exit, skipping atexit)

The kernel calls ``tl.static_print``, which prints while Triton generates its
IR, that is only when it really compiles the kernel, never on a cache hit: the
printed markers count the compiles. Prints one JSON object: per variant the
compiles seen and the SHA-256 of every file of the group, plus kernelcache's
counters when it is the manager.

``StallingManager`` is the holder of the fault tests: once it holds the claim
of its first group, it creates ``KC_TEST_HOLDING`` and stops mid-compile, then
waits for ``KC_TEST_GO``: ``raise`` makes the compile raise (the manager is
dropped), anything else (or no file) keeps it stalled until it is killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import time
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from kernelcache import triton as kt

TARGET = GPUTarget("cuda", 90, 32)
MARKER = "KC_COMPILED"  # what scale_kernel prints (a literal there: globals must be constexpr)


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_print("KC_COMPILED", VARIANT)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.exp(x * VARIANT) + tl.sqrt(tl.abs(x)) * (VARIANT + 1)
    tl.store(out_ptr + offs, tl.sum(y, axis=0) + y, mask=mask)


def source(variant: int) -> Any:
    return triton.compiler.ASTSource(
        scale_kernel,
        signature={
            "x_ptr": "*fp32",
            "out_ptr": "*fp32",
            "n": "i32",
            "VARIANT": "constexpr",
            "BLOCK": "constexpr",
        },
        constexprs={"VARIANT": variant, "BLOCK": 256},
    )


class StallingManager(kt.CacheManager):
    """kernelcache's manager that stalls mid-compile while holding its claim (see the docstring)."""

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        path = super().put(data, filename, binary=binary)
        holding = os.environ["KC_TEST_HOLDING"]
        if not os.path.exists(holding):
            open(holding, "w").close()
            while True:
                with contextlib.suppress(FileNotFoundError), open(os.environ["KC_TEST_GO"]) as f:
                    if f.read() == "raise":
                        raise RuntimeError("injected compile failure")
                time.sleep(0.01)
        return path


def _barrier(folder: str, parties: int) -> None:
    """Arrive, then wait until ``parties`` processes have (a file per process)."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    while len(os.listdir(folder)) < parties:
        time.sleep(0.001)


def _compile(variant: int) -> dict[str, str]:
    """Compile ``variant``; the digests of its group's files. The paths come from Triton's
    compile listener: Triton 3.4's ``CompiledKernel`` keeps no ``metadata_group``."""
    group: dict[str, str] = {}

    def listener(*, metadata_group: Any, **_: Any) -> None:
        group.update(metadata_group)

    triton.knobs.compilation.listener = listener
    try:
        triton.compile(source(variant), target=TARGET)
    finally:
        triton.knobs.compilation.listener = None
    files = {}
    for child, path in group.items():
        with open(path, "rb") as f:
            files[child] = hashlib.sha256(f.read()).hexdigest()
    return files


def _triton_key() -> str:
    """Triton's hash of its own installation (``triton.runtime.cache`` from 3.5; 3.4 keeps
    it in ``triton.compiler.compiler``)."""
    key = getattr(triton.runtime.cache, "triton_key", None)
    if key is None:
        key = triton.compiler.compiler.triton_key
    return str(key())


def run(opts: dict[str, Any]) -> dict[str, Any]:
    # Warm up outside the measured part: Triton hashes its own installation once per process.
    _triton_key()
    if opts.get("warm"):  # a variant no other process asks for: a miss everywhere
        with contextlib.redirect_stdout(io.StringIO()):
            triton.compile(source(1_000_000 + os.getpid()), target=TARGET)
    if opts.get("ready"):
        open(opts["ready"], "w").close()
    if opts.get("barrier"):
        _barrier(opts["barrier"], opts["parties"])
    start = time.perf_counter()
    out: dict[str, Any] = {"variants": {}, "errors": {}}
    printed = io.StringIO()
    for variant in opts["variants"]:
        try:
            with contextlib.redirect_stdout(printed):
                files = _compile(variant)
        except RuntimeError as exc:
            out["errors"][str(variant)] = str(exc)
            continue
        out["variants"][str(variant)] = {"files": files}
    out["seconds"] = time.perf_counter() - start
    lines = printed.getvalue().splitlines()
    for variant, result in out["variants"].items():
        result["compiles"] = lines.count(f"{MARKER} {variant}")
    out["compiles"] = sum(line.startswith(MARKER) for line in lines)
    manager = triton.knobs.cache.manager_class
    if manager is not None and issubclass(manager, kt.CacheManager):
        out["counters"] = kt.counters()
        out["compile_stats"] = kt.get_cache().compile_stats()
    return out


def _compile_one(variant: int) -> dict[str, str]:
    with contextlib.redirect_stdout(io.StringIO()):
        return _compile(variant)


def run_forked(opts: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(opts["fork"]) as pool:
        files = pool.map(_compile_one, opts["variants"])
    return {
        "variants": {str(v): {"files": f} for v, f in zip(opts["variants"], files, strict=True)}
    }


def main(argv: list[str]) -> int:
    opts = json.loads(argv[0])
    result = run_forked(opts) if opts.get("fork") else run(opts)
    print(json.dumps(result), flush=True)
    if opts.get("linger"):
        # Stay alive (a holder whose claim must be released by something else than exit).
        while not os.path.exists(opts["linger"]):
            time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
