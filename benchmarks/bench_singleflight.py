"""Single-flight and statistics costs.

(a) Latency a waiter pays after the compile finished: from the moment the
    leader's compile function returned to the moment the waiter's
    get_or_compile returned (the leader's put, its lock release, the waiter's
    wake-up and re-check). Measured for waiting threads of one process (the
    in-process flight) and for waiting processes (the disk tier's flock).
    Target: under 5 ms.
(b) Cost of the statistics on the hit path: a memory-tier hit through
    Cache.get against the same method without the statistics hook (the core's
    Cache.get before this change), interleaved rounds, medians. The deferred
    work (draining the hit sample on the next slow path) is reported per hit
    separately. Target: under 10 % of a memory hit.

Run: PYTHONPATH=src python benchmarks/bench_singleflight.py [--trials N] [--json FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # a sibling module: the script is run by path
from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings
from kernelcache.errors import StoreError
from kernelcache.stores.base import validate_key
from kernelcache.tiers import TierStack

COMPILE_SECONDS = 0.1


def _cache(path: str) -> Cache:
    return Cache([MemoryStore(), DiskStore(path)], settings=Settings.load(dir=path))


# (a) waiters -----------------------------------------------------------------
def _process_role(path: str, rank: int, trials: int, barrier: Any, fn_end: Any, out: Any) -> None:
    cache = _cache(path)

    def compile_fn() -> bytes:
        time.sleep(COMPILE_SECONDS)
        fn_end.value = time.monotonic()
        return os.urandom(1024)

    for trial in range(trials):
        barrier.wait()
        if rank:
            time.sleep(COMPILE_SECONDS / 4)  # ask while the leader compiles
        cache.get_or_compile(f"trial{trial}", compile_fn)
        out.put((trial, rank, time.monotonic()))
    cache.close()


def waiter_latency_processes(trials: int, waiters: int) -> list[float]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as path:
        barrier, fn_end, out = ctx.Barrier(waiters + 1), ctx.Value("d", 0.0), ctx.Queue()
        procs = [
            ctx.Process(target=_process_role, args=(path, rank, trials, barrier, fn_end, out))
            for rank in range(waiters + 1)
        ]
        for p in procs:
            p.start()
        latencies = []
        for trial in range(trials):
            returned = [out.get(timeout=60) for _ in range(waiters + 1)]
            end = fn_end.value
            assert all(t == trial for t, _, _ in returned)
            latencies += [when - end for _, rank, when in returned if rank]
        for p in procs:
            p.join(30)
    return latencies


def waiter_latency_threads(trials: int, waiters: int) -> list[float]:
    latencies = []
    with tempfile.TemporaryDirectory() as path, _cache(path) as cache:
        for trial in range(trials):
            fn_end = [0.0]

            def compile_fn(fn_end: list[float] = fn_end) -> bytes:
                time.sleep(COMPILE_SECONDS)
                fn_end[0] = time.monotonic()
                return os.urandom(1024)

            returned: list[tuple[bool, float]] = []

            def ask(
                waiter: bool, key: str = f"t{trial}", returned: list[tuple[bool, float]] = returned
            ) -> None:
                if waiter:
                    time.sleep(COMPILE_SECONDS / 4)  # ask while the leader compiles
                cache.get_or_compile(key, compile_fn)
                returned.append((waiter, time.monotonic()))

            threads = [threading.Thread(target=ask, args=(i > 0,)) for i in range(waiters + 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            latencies += [when - fn_end[0] for waiter, when in returned if waiter]
    return latencies


# (b) statistics on the hit path ----------------------------------------------
class BareCache(Cache):
    """Cache.get exactly as it was before statistics: the baseline."""

    def get(self, key: str) -> Entry | None:
        validate_key(key)
        for index, tier in enumerate(self.tiers):
            try:
                entry = tier.get(key)
            except StoreError:
                continue
            if entry is not None:
                if index:
                    TierStack.write(self.tiers[:index], key, entry)
                return entry
        return None


def per_hit_ns(get: Callable[[str], object], n: int) -> float:
    return min(timeit.repeat(lambda: get("k"), number=n, repeat=3)) / n * 1e9


def hit_cost(rounds: int) -> dict[str, float]:
    settings = Settings.load(dir=tempfile.gettempdir())
    entry = Entry({"kernel.cubin": b"x" * 4096}, meta={"compile_seconds": 0.5})
    with_stats = Cache([MemoryStore()], settings=settings)
    bare = BareCache([MemoryStore()], settings=settings)
    for cache in (with_stats, bare):
        cache.put("k", entry)
    n = 20000
    samples: dict[str, list[float]] = {"stats": [], "bare": []}
    for _ in range(rounds):
        for name, cache in (("stats", with_stats), ("bare", bare)):
            samples[name].append(per_hit_ns(cache.get, n))
    # The deferred part: draining the sample of n hits, per hit.
    drains = []
    for _ in range(rounds):
        for _ in range(n):
            with_stats.get("k")
        start = time.perf_counter()
        with_stats.compile_stats()  # drains the sampled hits, as the next slow path would
        drains.append((time.perf_counter() - start) / n * 1e9)
    stats_ns, bare_ns = statistics.median(samples["stats"]), statistics.median(samples["bare"])
    return {
        "memory_hit_bare_ns": bare_ns,
        "memory_hit_with_stats_ns": stats_ns,
        "overhead_pct": 100 * (stats_ns - bare_ns) / bare_ns,
        "deferred_drain_ns_per_hit": statistics.median(drains),
    }


def _summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "max_ms": ms[-1],
    }


def targets(report: dict[str, Any]) -> list[dict[str, str]]:
    """Waiter latency under 5 ms (each case), statistics under 10 % of a memory hit."""
    out = [
        results.target(
            f"waiter latency after a compile, {name}, < 5 ms",
            f"median {s['median_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms",
            s["median_ms"] < 5,
        )
        for name, s in report.items()
        if name.startswith(("threads", "processes"))
    ]
    h = report["hit_path"]
    out.append(
        results.target(
            "statistics on a memory hit, < 10 %",
            f"{h['memory_hit_with_stats_ns']:.0f} / {h['memory_hit_bare_ns']:.0f} ns",
            h["overhead_pct"] < 10,
            ratio=f"{h['overhead_pct']:+.1f} %",
        )
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    started = results.machine()
    report: dict[str, Any] = {}
    for waiters in (1, 3):
        report[f"threads, {waiters} waiting"] = _summary(
            waiter_latency_threads(args.trials, waiters)
        )
        report[f"processes, {waiters} waiting"] = _summary(
            waiter_latency_processes(args.trials, waiters)
        )
    report["hit_path"] = hit_cost(args.rounds)
    report["python"] = sys.version.split()[0]
    report["cpus"] = os.cpu_count()
    report["load_average"] = os.getloadavg()
    results.write(
        args.json,
        results.document(
            "bench_singleflight",
            contenders=["kernelcache Cache.get_or_compile", "Cache.get without statistics"],
            targets=targets(report),
            details=report,
            started=started,
        ),
    )
    print("latency from the end of the compile to each waiter's return (target < 5 ms):")
    for name, s in report.items():
        if name.startswith(("threads", "processes")):
            print(
                f"  {name:22} n={s['n']:3}  median {s['median_ms']:.3f} ms  "
                f"p90 {s['p90_ms']:.3f} ms  max {s['max_ms']:.3f} ms"
            )
    h = report["hit_path"]
    print(f"load average {report['load_average'][0]:.2f} on {report['cpus']} CPUs")
    print(f"memory hit, bare Cache.get     {h['memory_hit_bare_ns']:.0f} ns")
    print(
        f"memory hit, with statistics    {h['memory_hit_with_stats_ns']:.0f} ns  "
        f"({h['overhead_pct']:+.1f} %, target < 10 %)"
    )
    print(
        f"deferred drain, per hit        {h['deferred_drain_ns_per_hit']:.0f} ns "
        "(paid on the next miss/put/flush, not on the hit)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
