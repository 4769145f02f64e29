"""DiskStore at few vs many entries: a hit or a put must not cost more in a bigger cache.

The stores are filled through ``DiskStore.put`` with 1 KB entries under
random 64-hex-digit keys (what ``KeyBuilder.hexdigest()`` gives). Then,
interleaved (timing.measure): a hit on a random stored key and a put replacing a
random stored key, with a cap far above the contents (the accounting runs,
nothing is evicted); then puts of new keys with the cap set to the current
contents, so the store stays full and pays for eviction. Eviction is
amortised (the tier is cleaned down to 99 % of its cap from per-shard LRU
queues, a shard rescanned about once per turnover), so there the mean
matters as much as the median. Every value is 1 KB, so the
entry count stays where it was filled.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence

from kernelcache import DiskStore, Entry
from timing import Budget, Row, measure

VALUE_BYTES = 1024
UNCAPPED = 1 << 50


def _keys(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


def populate(path: str, n: int, rng: random.Random) -> tuple[DiskStore, list[str], float]:
    store = DiskStore(path, max_bytes=UNCAPPED)
    keys = _keys(rng, n)
    entry = Entry({"data": rng.randbytes(VALUE_BYTES)})
    start = time.perf_counter()
    for key in keys:
        store.put(key, entry)
    return store, keys, time.perf_counter() - start


def _getter(store: DiskStore) -> Callable[[str], object]:
    def get(key: str) -> object:
        entry = store.get(key)
        assert entry is not None, key  # every key timed was put first
        return entry["data"]

    return get


def _putter(store: DiskStore, value: Entry) -> Callable[[str], object]:
    return lambda key: store.put(key, value)


def run(root: str, counts: Sequence[int], seconds: float, rounds: int, overhead: int) -> list[Row]:
    rng = random.Random(1)
    value = Entry({"data": rng.randbytes(VALUE_BYTES)})
    stores: dict[int, DiskStore] = {}
    hits: dict[int, list[str]] = {}
    notes: dict[int, str] = {}
    try:
        for n in counts:
            stores[n], keys, took = populate(os.path.join(root, f"scale-{n}"), n, rng)
            hits[n] = rng.sample(keys, min(n, 4096))
            notes[n] = f"filled in {took:.1f} s ({took / n * 1e6:.0f} µs/put)"
        rows: dict[str, Row] = {}
        fns: dict[str, Callable[[str], object]] = {}
        keys_for: dict[str, Iterator[str]] = {}
        max_calls = max(50, int(seconds * 20_000))
        for n, store in stores.items():
            name = f"get {n}"
            rows[name] = Row("get", n, "DiskStore hit", note=notes[n])
            fns[name] = _getter(store)
            keys_for[name] = itertools.cycle(hits[n])
            name = f"put {n}"
            rows[name] = Row("put", n, "DiskStore put, replacing", note=notes[n])
            fns[name] = _putter(store, value)
            keys_for[name] = itertools.cycle(rng.sample(hits[n], len(hits[n])))
        budget = Budget(seconds=seconds, rounds=rounds, overhead=overhead)
        measure(rows, fns, keys_for, max_calls=max_calls, **budget)
        capped: dict[str, Row] = {}
        cap_fns: dict[str, Callable[[str], object]] = {}
        for n, store in stores.items():
            store.max_bytes = store.usage()[1]  # full: from here on every put evicts
            name = f"cap {n}"
            capped[name] = Row("put", n, "DiskStore put, new key, at cap (evicting)")
            cap_fns[name] = fns[f"put {n}"]
            keys_for[name] = iter(_keys(rng, max_calls + max_calls // rounds + 1))
        measure(capped, cap_fns, keys_for, max_calls=max_calls, **budget)
        for n, store in stores.items():
            evictions = store.counters.evictions
            capped[f"cap {n}"].note = f"{evictions} evictions; entries then {store.usage()[0]:,}"
    finally:
        for store in stores.values():
            store.close()
    return [*rows.values(), *capped.values()]


def table(rows: list[Row]) -> str:
    lines = [
        "| operation | entries | median µs | p99 µs | mean µs | round medians µs "
        "| × smallest | n | note |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    first: dict[str, Row] = {}
    for row in rows:
        base = first.setdefault(row.name, row)
        spread = f"{min(row.round_medians) / 1e3:.1f}–{max(row.round_medians) / 1e3:.1f}"
        lines.append(
            f"| {row.name} | {row.size:,} | {row.median / 1e3:.1f} | {row.p99 / 1e3:.1f} "
            f"| {row.mean / 1e3:.1f} | {spread} | {row.median / base.median:.2f}× "
            f"| {len(row.samples)} | {row.note} |"
        )
    return "\n".join(lines)
