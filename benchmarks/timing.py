"""Sampling for the benchmarks: single calls timed in interleaved, shuffled rounds."""

from __future__ import annotations

import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


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


def measure(
    rows: dict[str, Row],
    fns: dict[str, Callable[[str], object]],
    keys: dict[str, Iterator[str]],
    *,
    seconds: float,
    rounds: int,
    max_calls: int,
    overhead: int,
) -> None:
    """Fill ``rows`` with samples of ``fns(next(keys))`` (same names), in interleaved rounds.

    Each round runs every function for ``seconds / rounds`` (or ``max_calls /
    rounds`` calls), in a shuffled order, so load from other processes falls
    on all of them alike. Round 0 is a warm-up and is discarded.
    """
    order = list(fns)
    budget = seconds / rounds * 1e9
    per_round = max(1, max_calls // rounds)
    rng = random.Random(0)
    for index in range(rounds + 1):
        rng.shuffle(order)
        for name in order:
            gc.collect()  # a collection owed by setup code must not land in the samples
            got = run_chunk(fns[name], keys[name], budget, per_round)
            if index:
                got = [max(0, t - overhead) for t in got]
                rows[name].samples.extend(got)
                rows[name].round_medians.append(statistics.median(got))
