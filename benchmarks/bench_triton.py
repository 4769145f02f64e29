"""Triton through kernelcache vs Triton's FileCacheManager, and memoized handles, in one run.

    PYTHONPATH=src:tests python benchmarks/bench_triton.py [--quick]

1. Warm ``triton.compile`` (sm_90, ahead of time) of vector add, softmax and
   matmul: FileCacheManager vs kernelcache (memory + disk, and disk only:
   what every fresh process gets).
2. Group put (get_group miss, 7 puts, put_group) and group get (get_group,
   then reading every file, as CompiledKernel does) with the real files of
   the add kernel.
3. Repeated handle construction: warm triton.compile every time vs
   ``@memoize``; and what one memoize hit costs vs re-fingerprinting per call
   (the rejected design) and functools.lru_cache (not content-sensitive).

Medians of interleaved rounds; ratio = kernelcache / peer (< 1 is faster).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE.parent / "tests")]
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import numpy as np  # noqa: E402
import triton  # noqa: E402
from triton.runtime.cache import FileCacheManager  # noqa: E402

import kernelcache.triton as kt  # noqa: E402
import triton_kernels  # noqa: E402
from kernelcache import Cache, DiskStore, MemoryStore, fingerprint  # noqa: E402
from kernelcache.memoize import memoize  # noqa: E402

KERNELS = ["add", "softmax", "matmul"]
KC_MANAGER = "kernelcache.triton:CacheManager"


def median_us(fn: Callable[[], Any], rounds: int, inner: int = 1) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples) * 1e6


def use_manager(name: str | None) -> None:
    if name is None:
        os.environ.pop("TRITON_CACHE_MANAGER", None)
    else:
        os.environ["TRITON_CACHE_MANAGER"] = name


def row(label: str, ours: float, peer: float, peer_name: str) -> None:
    print(f"  {label:<44} {ours:10.1f} us   {peer_name} {peer:10.1f} us   ratio {ours / peer:5.2f}")


def bench_warm_compile(tmp: Path, rounds: int) -> None:
    print("Warm triton.compile, sm_90 (median per compile):")
    os.environ["TRITON_CACHE_DIR"] = str(tmp / "triton")
    both = Cache([MemoryStore(), DiskStore(tmp / "kc")])
    disk_only = Cache([DiskStore(tmp / "kc")])

    def kernelcache_with(cache: Cache) -> Callable[[], None]:
        def setup() -> None:
            use_manager(KC_MANAGER)
            kt.set_cache(cache)

        return setup

    setups = {
        "file": functools.partial(use_manager, None),
        "kc": kernelcache_with(both),
        "kc-disk": kernelcache_with(disk_only),
    }
    sources = {name: triton_kernels.source(name) for name in KERNELS}
    for setup in setups.values():  # cold compiles fill every cache
        setup()
        for src in sources.values():
            triton.compile(src, target=triton_kernels.TARGET)
    for name, src in sources.items():
        times: dict[str, list[float]] = {k: [] for k in setups}
        for _ in range(rounds):  # interleaved, so drift hits all three alike
            for label, setup in setups.items():
                setup()
                start = time.perf_counter()
                triton.compile(src, target=triton_kernels.TARGET)
                times[label].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        row(f"{name}: kernelcache (memory+disk)", med["kc"], med["file"], "FileCacheManager")
        row(f"{name}: kernelcache (disk only)", med["kc-disk"], med["file"], "FileCacheManager")
    use_manager(None)


def bench_groups(tmp: Path, rounds: int) -> None:
    print("Group put / get with the add kernel's 7 files (median per group):")
    kt.set_cache(Cache([DiskStore(tmp / "kc-groups")]))
    os.environ["TRITON_CACHE_DIR"] = str(tmp / "triton-groups")
    kernel = triton.compile(triton_kernels.source("add"), target=triton_kernels.TARGET)
    files = {c: Path(p).read_bytes() for c, p in kernel.metadata_group.items()}
    print(f"  ({len(files)} files, {sum(map(len, files.values())) / 1024:.1f} KiB)")
    counter = iter(range(10**9))

    def put(manager_cls: Any) -> Callable[[], None]:
        def run() -> None:
            manager = manager_cls(f"K{next(counter)}")
            manager.get_group("add_kernel.json")
            group = {c: manager.put(d, c, binary=c.endswith(".cubin")) for c, d in files.items()}
            manager.put_group("add_kernel.json", group)

        return run

    def get(manager_cls: Any, key: str) -> Callable[[], None]:
        def run() -> None:
            group = manager_cls(key).get_group("add_kernel.json")
            for path in group.values():
                with open(path, "rb") as f:
                    f.read()

        return run

    key = f"K{next(counter)}"
    for cls in (kt.CacheManager, FileCacheManager):
        put(cls)()  # warm-up
        m = cls(key)
        m.get_group("add_kernel.json")
        m.put_group("add_kernel.json", {c: m.put(d, c) for c, d in files.items()})
    ours, peer = interleaved(put(kt.CacheManager), put(FileCacheManager), rounds)
    row("group put", ours, peer, "FileCacheManager")
    ours, peer = interleaved(get(kt.CacheManager, key), get(FileCacheManager, key), rounds)
    row("group get + read files (disk tier)", ours, peer, "FileCacheManager")


def interleaved(
    ours: Callable[[], Any], peer: Callable[[], Any], rounds: int
) -> tuple[float, float]:
    """Medians in microseconds, alternating the two so drift on a shared machine hits both."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((ours, samples[0]), (peer, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]) * 1e6, statistics.median(samples[1]) * 1e6


def bench_handles(tmp: Path, rounds: int) -> None:
    print("Repeated handle construction (median per call):")
    kt.set_cache(Cache([MemoryStore(), DiskStore(tmp / "kc-handles")]))
    use_manager(KC_MANAGER)
    x = np.zeros((1024,), np.float32)

    def build(kernel: Any, block: int, arr: Any) -> Any:
        src = triton_kernels.source("add", block)
        return triton.compile(src, target=triton_kernels.TARGET)

    cached = memoize(maxsize=64)(build)
    kernel = triton_kernels.add_kernel
    cached(kernel, 1024, x)
    plain_us = median_us(lambda: build(kernel, 1024, x), rounds)
    memo_us = median_us(lambda: cached(kernel, 1024, x), rounds, inner=200)
    row("memoize hit vs warm triton.compile", memo_us, plain_us, "triton.compile")

    lru = functools.lru_cache(maxsize=64)(lambda n: n)
    lru(1)
    lru_us = median_us(lambda: lru(1), rounds, inner=2000)
    small = memoize(maxsize=64)(_small)
    small(3)
    small_us = median_us(lambda: small(3), rounds, inner=2000)
    refp_us = median_us(lambda: fingerprint.function(_small), rounds, inner=20)
    row("memoize hit, small function", small_us, lru_us, "lru_cache")
    row("  identity probes vs re-fingerprint per call", small_us, refp_us, "fingerprint")
    use_manager(None)


SCALE = 3


def _helper(n: int) -> int:
    return n * SCALE


def _small(n: int) -> int:
    return _helper(n) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    rounds = 11 if args.quick else 201
    print(f"triton {triton.__version__}, python {sys.version.split()[0]}, {rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        bench_warm_compile(Path(tmp), rounds)
        bench_groups(Path(tmp), rounds)
        bench_handles(Path(tmp), rounds)


if __name__ == "__main__":
    main()
