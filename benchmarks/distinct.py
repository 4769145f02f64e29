"""Distinct-key small gets: each of many keys read once, as a fresh process reads autotune
records, Triton's JSON groups or NVRTC logs (issue 40).

The side-by-side table of bench_stores.py cycles over a few hot keys; here
every get is of a key not read before in this pass, so a store that opens a
file per entry pays the open, and one that keeps rows in SQLite does not.
Contenders take turns key by key (shuffled per key), so load from other
processes lands on all of them alike; the median per get is printed with the
ratio to diskcache.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import contenders as ct

NAMES = (
    ct.RawRead.name,
    ct.Disk.name,
    ct.SQLite.name,
    ct.DiskCache.name,
)


def run(root: str, keys: int, size: int, passes: int) -> list[dict[str, Any]]:
    """``passes`` passes over ``keys`` fresh keys each; one row per contender."""
    value = random.Random(size).randbytes(size)
    opened, _missing = ct.open_all(root, f"distinct{size}")
    chosen = [c for c in opened if c.name in NAMES]
    samples: dict[str, list[int]] = {c.name: [] for c in chosen}
    try:
        for c in chosen:
            c.prepare(value)
        rnd = random.Random(0)
        for p in range(passes):
            names = [f"distinct-{p}-{i}" for i in range(keys)]
            for c in chosen:
                for key in names:
                    c.put(key)
            for key in names:
                rnd.shuffle(chosen)
                for c in chosen:
                    start = time.perf_counter_ns()
                    got = c.get(key)
                    samples[c.name].append(time.perf_counter_ns() - start)
                    if got != value:
                        raise AssertionError(f"{c.name} returned wrong bytes")
    finally:
        for c in opened:
            c.close()
    ref = statistics.median(samples[ct.DiskCache.name]) if ct.DiskCache.name in samples else None
    rows = []
    for name in NAMES:
        if name in samples:
            med = statistics.median(samples[name])
            rows.append(
                {
                    "contender": name,
                    "median_us": med / 1000,
                    "vs_diskcache": med / ref if ref else None,
                }
            )
    return rows


def table(rows: list[dict[str, Any]], keys: int, size: int, passes: int) -> str:
    lines = [
        f"Distinct-key gets of {size // 1024} KB: {keys} keys read once each, {passes} passes",
        "",
        "| contender | median get | / diskcache |",
        "|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['vs_diskcache']:.2f}x" if r["vs_diskcache"] else "n/a"
        lines.append(f"| {r['contender']} | {r['median_us']:.1f} us | {ratio} |")
    return "\n".join(lines)


def target(rows: list[dict[str, Any]], size: int) -> dict[str, str]:
    """Issue 40's target, with its verdict: a distinct-key DiskStore get ≤ diskcache's."""
    name = f"disk distinct-key get ≤ diskcache at {size // 1024} KB (issue 40)"
    disk = next((r for r in rows if r["contender"] == ct.Disk.name), None)
    ref = next((r for r in rows if r["contender"] == ct.DiskCache.name), None)
    if disk is None or ref is None:
        return {"target": name, "measured": "n/a (contender missing)", "verdict": "n/a"}
    ratio = disk["median_us"] / ref["median_us"]
    return {
        "target": name,
        "measured": f"{ratio:.2f}× ({disk['median_us']:.1f} / {ref['median_us']:.1f} µs)",
        "verdict": "PASS" if ratio <= 1 else "MISS",
    }
