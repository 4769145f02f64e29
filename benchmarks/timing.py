"""Sampling for the benchmarks: single calls timed in interleaved, shuffled rounds."""

from __future__ import annotations

import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict


@dataclass
class Row:
    """Samples (ns, timer overhead removed) of one contender doing one operation."""

    op: str
    size: int
    name: str
    guarantee: str = ""
    peer: bool = False
    verified: str = ""
    samples: list[int] = field(default_factory=list, repr=False)
    round_medians: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.samples)

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return float(ordered[max(0, -(-99 * len(ordered) // 100) - 1)])

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "samples"}
        if self.ok:
            out.update(median_ns=self.median, p99_ns=self.p99, mean_ns=self.mean)
            out["n"] = len(self.samples)
        return out


def run_chunk(
    fn: Callable[[str], object], keys: Iterator[str], budget_ns: float, max_calls: int
) -> list[int]:
    """Time single calls ``fn(key)`` until ``budget_ns`` or ``max_calls`` (at least one)."""
    clock = time.perf_counter_ns
    out = []
    start = clock()
    for key in itertools.islice(keys, max_calls):
        t0 = clock()
        fn(key)
        t1 = clock()
        out.append(t1 - t0)
        if t1 - start > budget_ns:
            break
    return out


def _noop(key: str) -> None:
    return None


def timer_overhead() -> int:
    """Median cost of the timing loop around a do-nothing Python call."""
    return int(statistics.median(run_chunk(_noop, itertools.repeat("k"), 50e6, 200_000)))


#: A contender runs this long (or this many calls) before the next one's turn: long
#: enough for steady state (warm CPU caches), short against changes in machine load.
CHUNK_CALLS = 1000
CHUNK_NS = 2e6


class Budget(TypedDict):
    """:func:`measure`'s time budget and timer overhead, for callers passing them to several calls."""

    seconds: float
    rounds: int
    overhead: int


def measure(
    rows: Mapping[str, Row],
    fns: Mapping[str, Callable[[str], object]],
    keys: Mapping[str, Iterator[str]],
    *,
    seconds: float,
    rounds: int,
    max_calls: int,
    overhead: int,
) -> None:
    """Fill ``rows`` with samples of ``fns(next(keys))`` (same names), finely interleaved.

    The functions take turns in short chunks (2 ms or 1000 calls), in a freshly
    shuffled order each turn, until each has spent ``seconds`` in its calls
    or made ``max_calls``: load from other processes then falls on all of
    them alike. One chunk each is a discarded warm-up. The cyclic collector
    is paused while timing (as timeit does) and run before. Each row's
    samples are cut into ``rounds`` consecutive slices whose medians show
    how stable the measurement was.
    """
    rng = random.Random(0)
    spent = dict.fromkeys(fns, 0)
    active = list(fns)
    gc.collect()
    gc.disable()
    try:
        for name in active:
            run_chunk(fns[name], keys[name], CHUNK_NS, CHUNK_CALLS)
        while active:
            rng.shuffle(active)
            for name in active:
                calls = min(CHUNK_CALLS, max_calls - len(rows[name].samples))
                got = run_chunk(fns[name], keys[name], CHUNK_NS, calls)
                spent[name] += sum(got)
                rows[name].samples.extend(max(0, t - overhead) for t in got)
            active = [
                n for n in active if spent[n] < seconds * 1e9 and len(rows[n].samples) < max_calls
            ]
    finally:
        gc.enable()
    for row in rows.values():
        cut = max(1, len(row.samples) // rounds)
        row.round_medians = [
            statistics.median(row.samples[i : i + cut])
            for i in range(0, len(row.samples) - cut + 1, cut)
        ]
