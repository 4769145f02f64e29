"""TileLang and ninetoothed with their own caches vs kernelcache, in fresh processes.

(a) Cold vs warm: one process compiles a kernel into an empty cache, a fresh
    process asks for it again. TileLang: elementwise add (sm_90) and GEMM
    (sm_90a), tvm_ffi backend, kernelcache vs TileLang's own kernel cache.
    ninetoothed: AOT ``make`` of an add kernel (five specialisations, one nvcc
    library), kernelcache vs ninetoothed (which has no cache for AOT outputs).
    Reported: seconds of the compile call in each process, and nvcc runs.
(b) N processes (default 4) asking for one missing kernel at once (they wait at
    a barrier after their imports): nvcc runs and wall time from release to the
    last process done, upstream vs kernelcache.
(c) ninetoothed's generated-source race: 2 processes generating and importing
    the same 200 new kernels in lockstep; failures with ninetoothed's own source
    cache vs kernelcache's atomic one.

No GPU is needed: a stand-in CUDA toolkit counts nvcc runs (tests/cuda_standin.py)
and a stand-in Triton driver reports sm_90 (tests/triton_standin.py); every
compile is real. Numbers come from one run on whatever machine runs it: compare
ratios, not absolute seconds, on a loaded machine.

Run: .venv/bin/python benchmarks/bench_dsl.py [--procs N] [--skip-tilelang] [--skip-ninetoothed] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(HERE.parent / "src"), str(TESTS)]

from cuda_standin import Toolkit, make_toolkit  # noqa: E402


def _env(toolkit: Toolkit, work: Path, dsl: str) -> dict[str, str]:
    env = toolkit.env()
    env["KERNELCACHE_DIR"] = str(work / "kc")
    env["TILELANG_CACHE_DIR"] = str(work / "tilelang")
    home = work / "home"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    path = [str(HERE.parent / "src"), str(TESTS)]
    if dsl == "ninetoothed":
        path.insert(0, str(TESTS / "standin_site"))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(path)
    for name in ("TILELANG_DISABLE_CACHE", "TRITON_CACHE_MANAGER"):
        env.pop(name, None)
    return env


def _script(dsl: str) -> str:
    return str(TESTS / ("tilelang_kernels.py" if dsl == "tilelang" else "ninetoothed_kernels.py"))


def _run_many(
    env: dict[str, str], dsl: str, args: list[str], count: int, barrier: Path, strict: bool = True
) -> tuple[list[dict[str, Any]], float]:
    """Start ``count`` processes, release them together, return their reports and the wall time.

    With ``strict=False`` a failed process is reported as ``{"failed": True}``.
    """
    extra = ["--wait-for", str(barrier)] if count > 1 else []
    procs = [
        subprocess.Popen([sys.executable, _script(dsl), *args, *extra], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]  # fmt: skip
    if count > 1:
        while len(list(barrier.parent.glob(barrier.name + ".ready.*"))) < count:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        barrier.touch()
    begin = time.perf_counter()
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            if strict:
                raise RuntimeError(f"{dsl} {args} failed:\n{err[-3000:]}")
            reports.append({"failed": True})
            continue
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports, time.perf_counter() - begin


def _fresh(work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def cold_warm(
    toolkit: Toolkit, root: Path, dsl: str, args: list[str], upstream: bool
) -> dict[str, Any]:
    work = _fresh(root / "coldwarm")
    env = _env(toolkit, work, dsl)
    flag = ["--upstream"] if upstream else []
    toolkit.reset()
    (cold,), _ = _run_many(
        env, dsl, [*args(work), *flag] if callable(args) else [*args, *flag], 1, work / "go"
    )
    cold_runs = len(toolkit.compiles())
    if dsl == "ninetoothed":
        shutil.rmtree(work / "out", ignore_errors=True)  # a fresh checkout: the outputs are gone
    (warm,), _ = _run_many(
        env, dsl, [*args(work), *flag] if callable(args) else [*args, *flag], 1, work / "go"
    )
    return {
        "cold_s": cold["seconds"],
        "warm_s": warm["seconds"],
        "cold_nvcc": cold_runs,
        "warm_nvcc": len(toolkit.compiles()) - cold_runs,
    }


def concurrent(
    toolkit: Toolkit, root: Path, dsl: str, args: Any, upstream: bool, procs: int
) -> dict[str, Any]:
    work = _fresh(root / "concurrent")
    env = _env(toolkit, work, dsl)
    toolkit.reset()
    argv = args(work) if callable(args) else list(args)
    flag = ["--upstream"] if upstream else []
    reports, wall = _run_many(env, dsl, [*argv, *flag], procs, work / "go", strict=False)
    failed = sum(1 for r in reports if r.get("failed"))
    return {"nvcc": len(toolkit.compiles()), "wall_s": wall, "failed": failed}


def race(toolkit: Toolkit, root: Path, upstream: bool) -> dict[str, Any]:
    work = _fresh(root / "race")
    env = _env(toolkit, work, "ninetoothed")
    argv = ["race", "200", "bench", *(["--upstream"] if upstream else [])]
    reports, _ = _run_many(env, "ninetoothed", argv, 2, work / "go")
    return {
        "imports": sum(r["count"] for r in reports),
        "failures": sum(r["failures"] for r in reports),
    }


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--skip-tilelang", action="store_true")
    parser.add_argument("--skip-ninetoothed", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    opts = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kernelcache-bench-dsl-"))
    try:
        toolkit = make_toolkit(root / "toolkit")
        cases: list[tuple[str, str, Any]] = []
        if not opts.skip_tilelang:
            cases += [("tilelang", "add sm_90 tvm_ffi", ["add", "tvm_ffi"]),
                      ("tilelang", "gemm sm_90a tvm_ffi", ["gemm", "tvm_ffi"])]  # fmt: skip
        if not opts.skip_ninetoothed:
            cases.append(("ninetoothed", "add AOT make", lambda work: ["aot", str(work / "out")]))
        cold_rows, many_rows = [], []
        for dsl, name, args in cases:
            for upstream in (True, False):
                cache = "upstream" if upstream else "kernelcache"
                row_id = {"dsl": dsl, "kernel": name, "cache": cache}
                row: dict[str, Any] = dict(row_id)
                row.update(cold_warm(toolkit, root, dsl, args, upstream))
                row["cold/warm"] = row["cold_s"] / max(row["warm_s"], 1e-9)
                cold_rows.append(row)
                many: dict[str, Any] = {**row_id, "procs": opts.procs}
                many.update(concurrent(toolkit, root, dsl, args, upstream, opts.procs))
                many_rows.append(many)
                print(f"done: {dsl} {name} {cache}", file=sys.stderr, flush=True)
        race_rows = []
        if not opts.skip_ninetoothed:
            for upstream in (True, False):
                race_rows.append(
                    {
                        "cache": "upstream" if upstream else "kernelcache",
                        **race(toolkit, root, upstream),
                    }
                )
        print("## (a) cold vs warm, fresh processes (seconds of the compile call)\n")
        print(
            _table(
                cold_rows,
                [
                    "dsl",
                    "kernel",
                    "cache",
                    "cold_s",
                    "warm_s",
                    "cold/warm",
                    "cold_nvcc",
                    "warm_nvcc",
                ],
            )
        )
        print(f"\n## (b) {opts.procs} processes asking for one missing kernel at once\n")
        print(_table(many_rows, ["dsl", "kernel", "cache", "procs", "nvcc", "wall_s", "failed"]))
        if race_rows:
            print("\n## (c) ninetoothed generated-source race (2 processes x 200 kernels)\n")
            print(_table(race_rows, ["cache", "imports", "failures"]))
        if opts.json:
            Path(opts.json).write_text(
                json.dumps(
                    {"cold_warm": cold_rows, "concurrent": many_rows, "race": race_rows}, indent=2
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
