"""``kernelcache demo``: compile the example kernels cold, then warm, and show what the cache saved.

Each kernel in ``examples/`` is compiled three ways: with NVRTC through
:func:`kernelcache.nvrtc.compile` (warm = a hit from this process's memory
tier, and from the disk tier as a new process would see it), and with nvcc
through the launcher as a build runs it: the ``kernelcache`` executable
installed beside this interpreter (its shell front, the warm server and the
compiled client; warm = a hit as CMake would get it). It uses the default ``Cache()``, so
``KERNELCACHE_DIR`` is respected. Cold runs are really cold: the demo first
deletes exactly the entries those compiles would hit (the NVRTC keys, the
launcher's manifests and results), and says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelcache.cache import Cache

KERNELS = ("vector_add.cu", "saxpy.cu", "reduction.cu")


def find_examples(explicit: str | None) -> Path:
    """``--examples``, else ``./examples``, else the checkout's ``examples/``."""
    candidates = [Path(explicit)] if explicit else []
    candidates += [Path.cwd() / "examples", Path(__file__).resolve().parents[2] / "examples"]
    for path in candidates:
        if all((path / name).is_file() for name in KERNELS):
            return path
    raise SystemExit(
        f"kernelcache demo: cannot find the example kernels ({', '.join(KERNELS)}); "
        "pass --examples DIR (a kernelcache checkout has them in examples/)"
    )


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _median_time(fn: Callable[[], Any], repeat: int) -> float:
    return statistics.median(_timed(fn)[0] for _ in range(repeat))


def nvrtc_rows(
    examples: Path, arch: str, repeat: int, used: list[Cache]
) -> list[tuple[str, str, float, float]]:
    """NVRTC rows; every Cache the rows looked in is appended to ``used`` (the summary)."""
    from kernelcache import nvrtc
    from kernelcache._defaults import default_cache
    from kernelcache.stores.memory import MemoryStore

    # Load NVRTC and hash its library once, outside the timings.
    nvrtc.compile("__global__ void warmup() {}", arch=arch, cache=Cache([MemoryStore()]))
    cache = default_cache()
    used.append(cache)
    rows = []
    for name in KERNELS:
        source = (examples / name).read_text()
        kwargs: dict[str, Any] = {"name": name, "arch": arch, "include_dirs": [str(examples)]}
        cache.delete(nvrtc.cache_key(source, **kwargs))
        cold, result = _timed(lambda: nvrtc.compile(source, cache=cache, **kwargs))  # noqa: B023
        assert not result.hit
        warm = _median_time(lambda: nvrtc.compile(source, cache=cache, **kwargs), repeat)  # noqa: B023
        rows.append((name, "nvrtc, memory hit", cold, warm))
        # A new Cache over the same directory: its memory tier is empty, as in a new process.
        fresh = Cache(settings=cache.settings)
        disk, result = _timed(lambda: nvrtc.compile(source, cache=fresh, **kwargs))  # noqa: B023
        assert result.hit
        used.append(fresh)
        rows.append((name, "nvrtc, disk hit", cold, disk))
    return rows


def nvcc_front() -> tuple[list[str], str]:
    """The command that runs the launcher as a build would, and its label.

    The ``kernelcache`` executable beside this interpreter (a venv's bin), else
    the one on ``PATH``; only without either ``python -m kernelcache``, whose
    start-up a real build never pays (issue 20: the demo timed that one).
    """
    beside = Path(sys.executable).parent / "kernelcache"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("kernelcache")
    if found:
        return [found], "kernelcache nvcc"
    return [sys.executable, "-m", "kernelcache"], "python -m kernelcache"


def nvcc_rows(examples: Path, arch: str, repeat: int) -> list[tuple[str, str, float, float]]:
    from kernelcache.nvcc import launcher as nvcc

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    front, label = nvcc_front()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kernelcache-demo-") as out:
        for name in KERNELS:
            argv = ["nvcc", f"-arch={arch}", "-cubin", f"-I{examples}", str(examples / name)]
            argv += ["-o", os.path.join(out, name + ".cubin")]
            nvcc.forget(argv)
            command = [*front, *argv]

            def run(command: list[str] = command) -> None:
                subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)

            cold = _timed(run)[0]
            run()  # the first hit may start the launcher's server: not what a build sees
            warm = _median_time(run, max(3, repeat // 20))
            rows.append((name, label, cold, warm))
    return rows


def print_table(rows: list[tuple[str, str, float, float]]) -> None:
    header = f"{'kernel':<15} {'compiler':<19} {'cold ms':>10} {'warm ms':>10} {'speed-up':>10}"
    print(header)
    print("-" * len(header))
    for kernel, compiler, cold, warm in rows:
        speedup = cold / warm if warm > 0 else float("inf")
        print(f"{kernel:<15} {compiler:<19} {_ms(cold):>10.2f} {_ms(warm):>10.3f} {speedup:>9.0f}x")


def print_stats(used: list[Cache]) -> None:
    """This demo's own lookups, per tier, summed over every Cache it used (the disk-hit
    rows' fresh ones included), then the launcher's counters for the directory."""
    from kernelcache._defaults import default_cache
    from kernelcache.nvcc.launcher import launcher_stats

    cache = default_cache()
    print(f"\ncache directory: {cache.settings.dir}")
    totals: dict[str, dict[str, Any]] = {}
    for one in used:
        for tier, info in one.stats().items():
            row = totals.setdefault(tier, {"hits": 0, "misses": 0, "puts": 0})
            for field in row:
                row[field] += info[field]
            row["entries"], row["bytes"] = info["entries"], info["bytes"]
    for tier, row in totals.items():
        counts = f"hits {row['hits']:>4}  misses {row['misses']:>4}  puts {row['puts']:>4}"
        print(f"  {tier:<7} {counts}  entries {row['entries']}  bytes {row['bytes']}")
    launcher = launcher_stats(cache.settings)
    if launcher:
        counts = "  ".join(
            f"{name} {launcher.get(name, 0)}"
            for name in ("hits", "misses", "uncacheable", "failed")
        )
        saved = float(launcher.get("seconds_saved", 0.0))
        print(f"  launcher (all processes, this directory): {counts}  saved {saved:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelcache demo", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90)")
    parser.add_argument("--examples", help="directory with the example kernels")
    parser.add_argument("--repeat", type=int, default=200, help="warm calls to time (median)")
    args = parser.parse_args(argv)
    examples = find_examples(args.examples)
    print(f"kernels from {examples}, arch {args.arch}")
    print(
        "cold = the entries these compiles would hit were deleted first "
        "(nvrtc.cache_key / nvcc.forget), so each cold run really compiles\n"
    )
    rows: list[tuple[str, str, float, float]] = []
    used: list[Cache] = []
    try:
        rows += nvrtc_rows(examples, args.arch, args.repeat, used)
    except ImportError as exc:
        print(f"(NVRTC rows skipped: {exc}; install kernelcache[nvrtc])")
    if shutil.which("nvcc"):
        rows += nvcc_rows(examples, args.arch, args.repeat)
    else:
        print("(nvcc rows skipped: nvcc is not on PATH)")
    print_table(rows)
    print_stats(used)
    for one in used[1:]:
        one.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
