"""TileLang and ninetoothed with their own caches vs kernelcache, in fresh processes.

(a) Cold vs warm, in fresh processes, each side in a cache directory of its own:
    - cold, first run: one process compiles a kernel into an EMPTY cache
      directory (kernelcache's memos of header trees and compilers are empty too);
    - hit: a fresh process asks for the same kernel again;
    - cold, cache in use: a third process compiles another variant of the kernel
      (new code, same toolchain), as every later compile of a sweep or a build does.
    TileLang: elementwise add (sm_90) and GEMM (sm_90a), tvm_ffi backend,
    kernelcache vs TileLang's own kernel cache. ninetoothed: AOT ``make`` of an
    add kernel (five specialisations, one nvcc library), kernelcache vs
    ninetoothed alone (it has no cache for AOT outputs).
    Reported: wall and CPU seconds (the process's and its children's: nvcc, the
    linker) of the compile call in each process, and nvcc runs; for kernelcache
    with TileLang, the CPU seconds of recording the header manifest after the
    call (nvcc's preprocessor runs, off the critical path) and whether the hit
    was found through it; and, before the call in the hit's process, the
    seconds of importing kernelcache's integration with install(), beside
    TileLang's own import.
(b) N processes (default 2, 4 and 8) asking for one missing kernel at once (they
    wait at a barrier after their imports): nvcc runs and wall time from release
    to the last process done, upstream vs kernelcache.
(c) ninetoothed's generated-source race: 2 processes generating and importing
    the same 200 new kernels in lockstep; failures with ninetoothed's own source
    cache vs kernelcache's atomic one.
(d) A sweep, as autotuning makes: one process per core (--sweep-procs), each
    compiling --sweep-kernels new TileLang add kernels (distinct sizes) one
    after another, the cache directory in use: wall time. With every core busy,
    work kernelcache does beside nvcc costs wall time, as it does not in (a).
Then each target of issue 23 (shared/DESIGN.md, "never slower than no cache")
with a verdict: cold <= 1.05x the tool's own, a fresh-process hit <= the tool's
own hit (the compile call, then with kernelcache's import added), N at once <=
the tool's own wall time, the sweep <= 1.05x the tool's own wall time. Wall time is the target; the CPU
ratio is printed beside it because a shared machine makes wall time noisy.

No GPU is needed: a stand-in CUDA toolkit counts nvcc runs (tests/cuda_standin.py)
and a stand-in Triton driver reports sm_90 (tests/triton_standin.py); every
compile is real. Runs alternate upstream and kernelcache; with --repeat R each
figure is the median of R runs.

Run: .venv/bin/python benchmarks/bench_dsl.py [--quick] [--repeat R] [--procs N ...]
     [--skip-tilelang] [--skip-ninetoothed] [--json FILE]
(--quick: the TileLang add kernel only, 2 processes at once, sweeps of 2 kernels: about
three minutes.)
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(HERE.parent / "src"), str(TESTS)]

import results  # noqa: E402
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
    env: dict[str, str],
    dsl: str,
    args: list[str],
    count: int,
    barrier: Path,
    strict: bool = True,
    own: Callable[[int], list[str]] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Start ``count`` processes, release them together, return their reports and the wall time.

    With ``strict=False`` a failed process is reported as ``{"failed": True}``;
    ``own(index)``: arguments of process ``index`` alone.
    """
    extra = ["--wait-for", str(barrier)] if count > 1 else []
    procs = [
        subprocess.Popen([sys.executable, _script(dsl), *args, *extra, *(own(index) if own else [])], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(count)
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


def cold_warm(toolkit: Toolkit, root: Path, dsl: str, args: Any, upstream: bool) -> dict[str, Any]:
    """Cold (empty cache directory), hit (fresh process), cold with the cache in use (TileLang)."""
    work = _fresh(root / "coldwarm")
    env = _env(toolkit, work, dsl)
    argv = [*(args(work) if callable(args) else args), *(["--upstream"] if upstream else [])]
    toolkit.reset()
    (cold,), _ = _run_many(env, dsl, argv, 1, work / "go")
    cold_runs = len(toolkit.compiles())
    if dsl == "ninetoothed":
        shutil.rmtree(work / "out", ignore_errors=True)  # a fresh checkout: the outputs are gone
    (warm,), _ = _run_many(env, dsl, argv, 1, work / "go")
    row = {
        "cold_s": cold["seconds"],
        "cold_cpu_s": cold["cpu_s"],
        "warm_s": warm["seconds"],
        "warm_cpu_s": warm["cpu_s"],
        # Outside the compile call, in the hit's process: kernelcache's import and
        # install(), and the tool's own import (TileLang only: ninetoothed reports neither).
        "warm_import_s": None if upstream else warm.get("import_s"),
        "tool_import_s": warm.get("tool_import_s"),
        # The header manifest's recording (nvcc's preprocessor runs), after the compile call.
        "manifest_cpu_s": cold.get("manifest_cpu_s"),
        "warm_via_manifest": warm.get("stats", {}).get("manifest_hits"),
        "cold_nvcc": cold_runs,
        "warm_nvcc": len(toolkit.compiles()) - cold_runs,
    }
    if dsl == "tilelang":
        (used,), _ = _run_many(env, dsl, [*argv, "--variant"], 1, work / "go")
        row.update(used_s=used["seconds"], used_cpu_s=used["cpu_s"])
    return row


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


def sweep(
    toolkit: Toolkit, root: Path, args: Any, upstream: bool, procs: int, kernels: int
) -> dict[str, Any]:
    """TileLang: ``procs`` processes at once, each compiling ``kernels`` new kernels one after
    another (distinct sizes), as an autotuning sweep keeps every core compiling, the cache
    directory in use (a first compile made it). Work beside nvcc is no longer free there."""
    work = _fresh(root / "sweep")
    env = _env(toolkit, work, "tilelang")
    argv = [*args, *(["--upstream"] if upstream else [])]
    _run_many(env, "tilelang", argv, 1, work / "go")
    toolkit.reset()

    def own(index: int) -> list[str]:  # int32 kernels: none is the first compile's
        return ["--sweep", f"{32 + index * kernels}:{kernels}"]

    _, wall = _run_many(env, "tilelang", argv, procs, work / "go", own=own)
    return {"procs": procs, "kernels": kernels, "nvcc": len(toolkit.compiles()), "wall_s": wall}


def sweeps(toolkit: Toolkit, root: Path, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """:func:`sweep` rows of the TileLang add kernel, medians of ``--repeat`` runs each side."""
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for rep in range(opts.repeat):
        for upstream in (True, False) if rep % 2 == 0 else (False, True):
            runs[upstream].append(
                sweep(
                    toolkit,
                    root,
                    ["add", "tvm_ffi"],
                    upstream,
                    opts.sweep_procs,
                    opts.sweep_kernels,
                )
            )
    return [
        {"dsl": "tilelang", "kernel": "add sm_90 tvm_ffi", "cache": "upstream" if up else "kernelcache",
         **runs[up][0], "wall_s": statistics.median(r["wall_s"] for r in runs[up]), "runs": len(runs[up])}
        for up in (True, False)
    ]  # fmt: skip


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


COLD_LIMIT = 1.05  # issue 23: a cold compile within 1.05x of the tool's own
MEDIANS = ("cold_s", "cold_cpu_s", "warm_s", "warm_cpu_s", "used_s", "used_cpu_s", "manifest_cpu_s",
           "warm_import_s", "tool_import_s")  # fmt: skip


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of medians over repeated runs (counts from the first run)."""
    out = dict(rows[0])
    for name in MEDIANS:
        values = [row[name] for row in rows if row.get(name) is not None]
        out[name] = statistics.median(values) if values else None
    out["runs"] = len(rows)
    return out


def _verdict(label: str, ours: float, theirs: float, limit: float, cpu: str = "") -> dict[str, Any]:
    ratio = ours / max(theirs, 1e-9)
    return {
        "target": label,
        "kernelcache": ours,
        "upstream": theirs,
        "ratio": ratio,
        "cpu ratio": cpu,
        "limit": f"<= {limit:.2f}x",
        "verdict": "PASS" if ratio <= limit else "MISS",
    }


def targets(
    cold: list[dict[str, Any]],
    many: list[dict[str, Any]],
    sweeps: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Issue 23's targets, kernelcache vs the tool alone, each with PASS or MISS."""
    out = []
    pairs = {(r["dsl"], r["kernel"], r["cache"]): r for r in cold}
    for (dsl, kernel, cache), ours in pairs.items():
        theirs = pairs.get((dsl, kernel, "upstream"))
        if cache != "kernelcache" or theirs is None:
            continue
        checks = [("cold, first run", "cold", COLD_LIMIT), ("hit, fresh process", "warm", 1.0)]
        if ours.get("used_s") is not None:
            checks.insert(1, ("cold, cache in use", "used", COLD_LIMIT))
        for label, field, limit in checks:
            cpu = ours[f"{field}_cpu_s"] / max(theirs[f"{field}_cpu_s"], 1e-9)
            out.append(
                _verdict(f"{dsl} {kernel}: {label}", ours[f"{field}_s"], theirs[f"{field}_s"],
                         limit, f"{cpu:.2f}")
            )  # fmt: skip
        if ours.get("warm_import_s") is not None:
            # The same hit with what the process paid before it: importing kernelcache.
            label = f"{dsl} {kernel}: hit, fresh process, kernelcache's import included"
            out.append(
                _verdict(label, ours["warm_s"] + ours["warm_import_s"], theirs["warm_s"], 1.0)
            )
    walls = {(r["dsl"], r["kernel"], r["procs"], r["cache"]): r for r in many}
    for (dsl, kernel, procs, cache), ours in walls.items():
        theirs = walls.get((dsl, kernel, procs, "upstream"))
        if cache == "kernelcache" and theirs is not None:
            label = f"{dsl} {kernel}: {procs} processes at once, wall ({ours['nvcc']} nvcc vs {theirs['nvcc']})"
            out.append(_verdict(label, ours["wall_s"], theirs["wall_s"], 1.0))
    rows = {(r["dsl"], r["kernel"], r["cache"]): r for r in sweeps}
    for (dsl, kernel, cache), ours in rows.items():
        theirs = rows.get((dsl, kernel, "upstream"))
        if cache == "kernelcache" and theirs is not None:
            label = f"{dsl} {kernel}: sweep, {ours['procs']} processes x {ours['kernels']} new kernels, wall"
            out.append(_verdict(label, ours["wall_s"], theirs["wall_s"], COLD_LIMIT))
    return out


def as_targets(verdicts: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The verdicts in the shape every benchmark's JSON shares (results.py)."""
    return [
        results.target(
            v["target"],
            f"{v['kernelcache']:.3f} / {v['upstream']:.3f} s"
            + (f" (CPU {v['cpu ratio']}×)" if v["cpu ratio"] else ""),
            v["verdict"],
            ratio=f"{v['ratio']:.2f}×",
            limit=v["limit"],
        )
        for v in verdicts
    ]


def _cases(opts: argparse.Namespace) -> list[tuple[str, str, Any]]:
    cases: list[tuple[str, str, Any]] = []
    if not opts.skip_tilelang:
        cases.append(("tilelang", "add sm_90 tvm_ffi", ["add", "tvm_ffi"]))
        if not opts.quick:
            cases.append(("tilelang", "gemm sm_90a tvm_ffi", ["gemm", "tvm_ffi"]))
    if not opts.skip_ninetoothed and not opts.quick:
        cases.append(("ninetoothed", "add AOT make", lambda work: ["aot", str(work / "out")]))
    return cases


def measure(
    toolkit: Toolkit, root: Path, opts: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Cold/warm rows and N-at-once rows; upstream and kernelcache alternate which goes first."""
    cold_rows, many_rows = [], []
    for dsl, name, args in _cases(opts):
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for rep in range(opts.repeat):
            for upstream in (True, False) if rep % 2 == 0 else (False, True):
                runs[upstream].append(cold_warm(toolkit, root, dsl, args, upstream))
        for upstream in (True, False):
            cache = "upstream" if upstream else "kernelcache"
            row = {"dsl": dsl, "kernel": name, "cache": cache, **_median(runs[upstream])}
            row["cold/warm"] = row["cold_s"] / max(row["warm_s"], 1e-9)
            cold_rows.append(row)
        for index, procs in enumerate(opts.procs):
            # One run of N processes moved a verdict by up to 9 % between runs: medians too.
            at_once: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for rep in range(opts.repeat):
                for upstream in (True, False) if (index + rep) % 2 == 0 else (False, True):
                    at_once[upstream].append(concurrent(toolkit, root, dsl, args, upstream, procs))
            for upstream in (True, False):
                cache = "upstream" if upstream else "kernelcache"
                runs_n = at_once[upstream]
                many_rows.append({
                    "dsl": dsl, "kernel": name, "cache": cache, "procs": procs,
                    "nvcc": max(r["nvcc"] for r in runs_n),
                    "wall_s": statistics.median(r["wall_s"] for r in runs_n),
                    "failed": sum(r["failed"] for r in runs_n), "runs": len(runs_n),
                })  # fmt: skip
        print(f"done: {dsl} {name}", file=sys.stderr, flush=True)
    return cold_rows, many_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per cold/warm, N-at-once and sweep figure (median)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="TileLang add only, 2 at once")
    parser.add_argument("--skip-tilelang", action="store_true")
    parser.add_argument("--skip-ninetoothed", action="store_true")
    parser.add_argument("--sweep-procs", type=int, default=os.cpu_count() or 2,
                        help="processes of the sweep (default: one per core)")  # fmt: skip
    parser.add_argument("--sweep-kernels", type=int, default=3, help="new kernels per process")
    parser.add_argument("--json", help="also write the results to this file")
    opts = parser.parse_args()
    if opts.quick:
        opts.procs = [2]
        opts.sweep_kernels = 2

    # Byte-compiled as an installed package is (pip compiles at install), so the import
    # figures are a user's, also where PYTHONDONTWRITEBYTECODE keeps a checkout uncompiled.
    compileall.compile_dir(str(HERE.parent / "src" / "kernelcache"), quiet=1)
    started = results.machine()
    root = Path(tempfile.mkdtemp(prefix="kernelcache-bench-dsl-"))
    try:
        toolkit = make_toolkit(root / "toolkit")
        cold_rows, many_rows = measure(toolkit, root, opts)
        race_rows = []
        if not opts.skip_ninetoothed and not opts.quick:
            for upstream in (True, False):
                cache = "upstream" if upstream else "kernelcache"
                race_rows.append({"cache": cache, **race(toolkit, root, upstream)})
        sweep_rows = [] if opts.skip_tilelang else sweeps(toolkit, root, opts)
        verdicts = targets(cold_rows, many_rows, sweep_rows)
        report(cold_rows, many_rows, race_rows, sweep_rows, verdicts)
        details = {"cold_warm": cold_rows, "concurrent": many_rows, "race": race_rows,
                   "sweep": sweep_rows, "targets": verdicts}  # fmt: skip
        contenders = sorted({f"{r['dsl']} ({r['cache']})" for r in cold_rows + many_rows})
        results.write(
            opts.json,
            results.document("bench_dsl", contenders=contenders, targets=as_targets(verdicts),
                             details=details, started=started),
        )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(
    cold_rows: list[dict[str, Any]],
    many_rows: list[dict[str, Any]],
    race_rows: list[dict[str, Any]],
    sweep_rows: list[dict[str, Any]],
    verdicts: list[dict[str, Any]],
) -> None:
    print("## (a) cold vs warm, fresh processes (wall and CPU seconds of the compile call)\n")
    columns = ["dsl", "kernel", "cache", "cold_s", "cold_cpu_s", "warm_s", "warm_cpu_s",
               "used_s", "used_cpu_s", "cold/warm", "cold_nvcc", "warm_nvcc", "manifest_cpu_s",
               "warm_via_manifest", "warm_import_s", "tool_import_s", "runs"]  # fmt: skip
    print(_table(cold_rows, columns))
    print(
        "\n(used: cold compile of another variant, the cache directory in use; manifest_cpu_s:"
        " recording TileLang's header manifest after the compile call, nvcc's preprocessor"
        " included; warm_via_manifest: the hit checked that manifest, not the header trees;"
        " warm_import_s: importing kernelcache's integration and install() in the hit's process,"
        " before the compile call; tool_import_s: the tool's own import in that process)"
    )
    print("\n## (b) N processes asking for one missing kernel at once\n")
    print(
        _table(many_rows, ["dsl", "kernel", "cache", "procs", "nvcc", "wall_s", "failed", "runs"])
    )
    print("\n(nvcc: the most runs of any repetition; wall_s: the median; failed: all repetitions)")
    if race_rows:
        print("\n## (c) ninetoothed generated-source race (2 processes x 200 kernels)\n")
        print(_table(race_rows, ["cache", "imports", "failures"]))
    if sweep_rows:
        print("\n## (d) a sweep: every core compiling new kernels, one process per core\n")
        print(_table(sweep_rows, ["dsl", "kernel", "cache", "procs", "kernels", "nvcc", "wall_s",
                                  "runs"]))  # fmt: skip
    print("\n## targets (issue 23: never slower than no cache)\n")
    print(_table(verdicts, ["target", "kernelcache", "upstream", "ratio", "cpu ratio", "limit",
                            "verdict"]))  # fmt: skip


if __name__ == "__main__":
    main()
