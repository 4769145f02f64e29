"""Per-process statistics of a Cache, merged into the cache directory in batches.

Hits, misses, puts, evictions, errors and bytes are the tiers' own counters
(``Store.counters``), which they keep anyway; the recorder only remembers
what it already flushed and merges the difference. What the tiers cannot
know is added here: compile counts and seconds, and *seconds saved* (the
``compile_seconds`` recorded in the meta of every entry that was a hit, but
once for a compile published inside another: see :meth:`Recorder.hit`).

A hit in a memory tier in front (well under a microsecond) only appends its
key to a bounded sample; the sample is drained on the next slow path (a
miss, a put, a flush), where the keys are counted and priced with the
``compile_seconds`` noted when each entry was put or promoted into that
tier. Seconds saved and per-key hits are exact while fewer than
``HIT_SAMPLE`` such hits happen between two drains, and are scaled up from
the most recent ``HIT_SAMPLE`` beyond that (a hot loop). Entries placed into
the memory tier behind the Cache's back count as hits that saved 0 seconds.
Hits in every other tier are counted exactly as they happen.

Flushes happen at exit, when the Cache is closed or collected, and on a slow
path at most every ``FLUSH_INTERVAL`` seconds; a process killed with SIGKILL
loses only what it counted since its last flush.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry
from kernelcache.keys import family_of
from kernelcache.stats.totals import COMPILE_FIELDS, merge
from kernelcache.stores.base import Store

FLUSH_INTERVAL = 10.0
HIT_SAMPLE = 65536
#: The key -> compile_seconds map is trimmed to the memory tier's keys beyond this.
PRICES_MIN = 4096
#: Keys whose next hit saved nothing more (see Recorder.hit); the oldest go beyond this.
CREDITED_MAX = 4096

# Those keys, per cache directory: the Caches an integration makes over one directory
# (kernelcache.inductor's C++ builds use one without the memory tier) count into the
# same statistics, so an outer entry's hit in one covers the inner one's in another.
_credited_by_dir: dict[str, dict[str, None]] = {}
_credited_lock = threading.Lock()


def tier_names(tiers: Sequence[Store]) -> list[str]:
    """Stable names for tiers: their kind, numbered when a kind repeats (disk, disk2)."""
    names: list[str] = []
    for tier in tiers:
        name, suffix = tier.kind, 2
        while name in names:
            name, suffix = f"{tier.kind}{suffix}", suffix + 1
        names.append(name)
    return names


def compile_seconds(entry: Entry) -> float:
    """The compile time recorded in an entry's meta; 0 when absent or malformed."""
    try:
        value = entry.meta.get("compile_seconds")
    except CorruptEntry:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return max(0.0, float(value))
    return 0.0


def nested_keys(entry: Entry) -> list[str]:
    """The entries published inside this entry's compile (its meta's ``nested``)."""
    try:
        value = entry.meta.get("nested")
    except CorruptEntry:
        return []
    if isinstance(value, list):
        return [key for key in value if isinstance(key, str)]
    return []


class Recorder:
    """Counts one Cache's activity and merges it into ``directory`` (if any).

    Thread-safe. ``sample`` is appended to by ``Cache.get`` without a lock
    (``deque.append`` is atomic); everything else happens under ``_lock``.
    """

    def __init__(self, tiers: Sequence[Store], directory: str | None) -> None:
        self.tiers = list(tiers)
        self.names = tier_names(self.tiers)
        self.directory = directory
        #: Whether first-tier hits go to ``sample`` (see the module docstring).
        self.sampling = bool(self.tiers) and self.tiers[0].in_process
        self.sample: collections.deque[str] = collections.deque(maxlen=HIT_SAMPLE)
        self.flush_errors = 0
        self.restart()
        _recorders.add(self)

    def restart(self) -> None:
        """(Re)start counting from the tiers' current counters (also after fork)."""
        self._lock = threading.Lock()
        self._flushed = [self._counters(tier) for tier in self.tiers]
        self._sampled_hits = self.tiers[0].counters.hits if self.tiers else 0
        self._saved = [0.0] * len(self.tiers)
        self._compile: dict[str, float] = dict.fromkeys(COMPILE_FIELDS, 0)
        self._keys: dict[str, list[float]] = {}
        #: Per integration family (kernelcache.keys.family_of): hits, misses, compiles, ...
        self._families: dict[str, dict[str, float]] = {}
        # Keys of entries compiled inside an entry that was a hit (insertion-ordered).
        self._credited: dict[str, None] = (
            {} if self.directory is None else _credited_by_dir.setdefault(self.directory, {})
        )
        self._last_flush = time.monotonic()
        self.saved_total = [0.0] * len(self.tiers)
        self.compile_total: dict[str, float] = dict.fromkeys(COMPILE_FIELDS, 0)
        self.sample.clear()  # the parent flushes what it sampled before the fork
        if not hasattr(self, "_prices"):
            self._prices: dict[str, float] = {}  # key -> compile_seconds, for sampled hits
            self._prices_limit = PRICES_MIN

    @staticmethod
    def _counters(tier: Store) -> dict[str, int]:
        return tier.counters.as_dict()

    # Recording --------------------------------------------------------
    def hit(self, index: int, key: str, entry: Entry) -> None:
        """A hit counted as it happens (every tier but a sampled first one).

        An entry compiled inside another one's compile saved nothing more when it
        follows that one's hit (torch loads an AOTAutograd hit's FX graphs, each
        a hit of its own): the outer hit already counted the whole compile. Each
        inner key is credited once, until its next hit in this process, in any
        Recorder of the same directory.
        """
        seconds = price = compile_seconds(entry)
        nested = nested_keys(entry)
        with self._lock:
            if self._credited or nested:
                with _credited_lock:
                    credited = self._credited
                    if key in credited:
                        del credited[key]
                        seconds = 0.0
                    for inner in nested:
                        credited[inner] = None
                    while len(credited) > CREDITED_MAX:
                        del credited[next(iter(credited))]
            self._saw(index, key, seconds, 1)
            if self.sampling:
                self._price_locked(key, price)  # it was just promoted into the first tier

    def note(self, key: str, entry: Entry) -> None:
        """``entry`` was put into the tiers: remember its price for sampled hits, and
        count a compiled one for its family."""
        seconds = compile_seconds(entry)
        with self._lock:
            if self.sampling:
                self._price_locked(key, seconds)
            if seconds:
                self._family_locked(key, "compiles", 1)
                self._family_locked(key, "compile_seconds", seconds)

    def missed(self, key: str) -> None:
        """A lookup of ``key`` missed every tier (``Cache.get``): counted for its family."""
        with self._lock:
            self._family_locked(key, "misses", 1)
        self.tick()

    def _family_locked(self, key: str, name: str, amount: float) -> None:
        counts = self._families.setdefault(family_of(key), {})
        counts[name] = counts.get(name, 0) + amount

    def _price_locked(self, key: str, seconds: float) -> None:
        self._prices[key] = seconds
        if len(self._prices) > self._prices_limit:
            # Keep the prices of what the memory tier still holds; it evicts on its own.
            held = set(self.tiers[0].keys())
            self._prices = {k: v for k, v in self._prices.items() if k in held}
            self._prices_limit = max(PRICES_MIN, 2 * len(self._prices))

    def _saw(self, index: int, key: str | None, seconds: float, hits: float) -> None:
        self._saved[index] += seconds * hits
        self.saved_total[index] += seconds * hits
        if key is not None:
            slot = self._keys.setdefault(key, [0, 0.0])
            slot[0] += hits
            slot[1] += seconds * hits
            self._family_locked(key, "hits", hits)
            self._family_locked(key, "seconds_saved", seconds * hits)

    def count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._compile[name] += amount
            self.compile_total[name] += amount

    def compiled(self, seconds: float) -> None:
        with self._lock:
            for name, amount in (("compiles", 1), ("compile_seconds", seconds)):
                self._compile[name] += amount
                self.compile_total[name] += amount

    def tick(self) -> None:
        """On a slow path: account for sampled hits, flush if one is due."""
        if self.sample:
            with self._lock:
                self._drain_locked()
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL:
            self.flush()

    def _drain_locked(self) -> None:
        if not self.sampling:
            return
        hits_now = self.tiers[0].counters.hits
        hits = hits_now - self._sampled_hits
        self._sampled_hits = hits_now
        # Two C calls, no per-item Python: a hit appended between them by
        # another thread is lost from the sample (not from the hit counters).
        batch = list(self.sample)
        self.sample.clear()
        if not batch:
            return
        # Beyond HIT_SAMPLE hits since the last drain, the sample (the most
        # recent hits) stands for all of them.
        taken = len(batch)
        scale = hits / taken if taken >= HIT_SAMPLE and hits > taken else 1.0
        prices = self._prices
        for key, n in collections.Counter(batch).items():
            self._saw(0, key, prices.get(key, 0.0), n * scale)

    # Reporting and flushing ----------------------------------------------
    def local(self) -> tuple[list[float], dict[str, float]]:
        """This process's seconds saved per tier and compile counters so far."""
        with self._lock:
            self._drain_locked()
            return list(self.saved_total), dict(self.compile_total)

    def flush(self) -> None:
        """Merge what was counted since the last flush into the directory's totals."""
        with self._lock:
            self._drain_locked()
            tiers: dict[str, dict[str, float]] = {}
            for index, tier in enumerate(self.tiers):
                now = self._counters(tier)
                before = self._flushed[index]
                delta: dict[str, float] = {k: v - before.get(k, 0) for k, v in now.items()}
                delta["seconds_saved"] = self._saved[index]
                self._flushed[index], self._saved[index] = now, 0.0
                if any(delta.values()):
                    tiers[self.names[index]] = delta
            compile_counts = {k: v for k, v in self._compile.items() if v}
            held_keys, keys = self._keys, {k: (round(v[0]), v[1]) for k, v in self._keys.items()}
            families = self._families
            self._compile = dict.fromkeys(COMPILE_FIELDS, 0)
            self._keys = {}
            self._families = {}
            self._last_flush = time.monotonic()
        if self.directory is None or not (tiers or compile_counts or keys or families):
            return
        try:
            merge(self.directory, tiers, compile_counts, keys, families)
        except TimeoutError:
            self._put_back(tiers, compile_counts, held_keys, families)  # another merge was slow
        except OSError:
            # Statistics never fail the user's work: a read-only or removed
            # directory loses this batch, and the loss is counted.
            self.flush_errors += 1

    def _put_back(
        self,
        tiers: dict[str, dict[str, float]],
        compile_counts: dict[str, float],
        keys: dict[str, list[float]],
        families: dict[str, dict[str, float]],
    ) -> None:
        """Count a batch that could not be merged in the next flush instead (issue 40)."""
        with self._lock:
            for index, name in enumerate(self.names):
                delta = tiers.get(name)
                if delta is None:
                    continue
                self._saved[index] += delta.pop("seconds_saved", 0.0)
                flushed = self._flushed[index]
                for k, v in delta.items():
                    flushed[k] = flushed.get(k, 0) - int(v)
            for k, v in compile_counts.items():
                self._compile[k] += v
            for k, (hits, seconds) in keys.items():
                slot = self._keys.setdefault(k, [0, 0.0])
                slot[0] += hits
                slot[1] += seconds
            for family, counts in families.items():
                mine = self._families.setdefault(family, {})
                for name, amount in counts.items():
                    mine[name] = mine.get(name, 0) + amount


_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _credited_lock
    _credited_lock = threading.Lock()  # another thread of the parent may have held it
    # The child inherits the parent's unflushed counts; the parent flushes them.
    for recorder in list(_recorders):
        recorder.restart()


os.register_at_fork(after_in_child=_after_fork_in_child)


def persistent_dir(tiers: Sequence[Store]) -> str | None:
    """Where a Cache over ``tiers`` keeps its statistics: its first tier's local directory."""
    for tier in tiers:
        if tier.local_dir is not None:
            return tier.local_dir
    return None
