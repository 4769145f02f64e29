"""The Cache: tiers composed, read-through with promotion, failures as misses."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.keys import MISSED
from kernelcache.settings import Settings
from kernelcache.singleflight import Claim, SingleFlight
from kernelcache.stats import Recorder, persistent_dir
from kernelcache.stores.base import Store, validate_key
from kernelcache.tiers import TierStack, default_tiers, settings_dir, unexpected

#: How long a caller waits for another's compile of the same key before compiling itself.
DEFAULT_TIMEOUT = 300.0


class Cache:
    """Tiers searched in order (fastest first); hits are promoted to faster tiers.

    Writes go to every writable tier. A tier that fails (I/O error, disk full,
    database locked or corrupt, remote down) costs a miss and a counter in its
    stats, never an exception from :meth:`get` or :meth:`put`. Thread-safe
    when its tiers are (all built-in ones are).

    Statistics are merged in batches into the first disk tier's directory
    (``kernelcache stats``) unless ``persist_stats=False``.
    """

    def __init__(
        self,
        tiers: Sequence[Store] | None = None,
        *,
        settings: Settings | None = None,
        persist_stats: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else Settings.load()
        self.tiers: list[Store] = list(default_tiers(self.settings) if tiers is None else tiers)
        for tier in self.tiers:
            if not isinstance(tier, Store):
                raise TypeError(f"Cache tiers must be Store instances, not {type(tier).__name__}")
        # Statistics live in the settings' directory when the settings chose the
        # tiers (whatever the local tier's kind), else in the first local tier's.
        #: The directory whose statistics ``kernelcache stats`` shows for this cache.
        self.stats_dir = (
            settings_dir(self.settings, self.tiers) if tiers is None else persistent_dir(self.tiers)
        )
        # Read-only settings write nothing into the directory, statistics included.
        record = persist_stats and not (tiers is None and self.settings.read_only)
        self._stats = Recorder(self.tiers, self.stats_dir if record else None)
        # Collaborators that do not refer back to the Cache: a cycle would leave a
        # dropped Cache (and its last statistics flush) to the cyclic collector,
        # which may run it at any allocation, even inside another flush.
        self._stack = TierStack(self.tiers, self._stats)
        self._flight = SingleFlight(
            self.tiers, self._stack.lookup_from, self._stack.store, self._stats
        )
        self._sample = self._stats.sample
        self._exact_first = not self._stats.sampling
        # Flushes at close, when the Cache is collected, and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._stats.flush)

    def __repr__(self) -> str:
        return f"Cache({self.tiers!r})"

    def get(self, key: str) -> Entry | None:
        """The entry for ``key`` from the first tier that has it, or ``None``."""
        validate_key(key)
        for index, tier in enumerate(self.tiers):
            try:
                entry = tier.get(key)
            except StoreError:
                continue  # counted by the tier; the next tier may still have it
            except Exception as exc:  # the tier boundary: see tiers.unexpected
                unexpected(tier, exc)
                continue
            if entry is not None:
                if index or self._exact_first:
                    return self._stack.hit(index, key, entry)
                self._sample.append(key)  # a memory hit: stats cost one append
                return entry
        MISSED.append(key)  # its fields, if built here, explain it (kernelcache.explain)
        self._stats.missed(key)
        return None

    def put(self, key: str, entry: Entry) -> Entry:
        """Store ``entry`` in every writable tier; failing tiers are skipped and counted.

        Returns the entry as the cache now holds it (bound to ``key``; its
        ``path()`` gives files inside the disk tier when there is one).
        ``entry`` itself is not modified.
        """
        validate_key(key)
        if not isinstance(entry, Entry):
            raise TypeError(f"Cache.put takes an Entry, not {type(entry).__name__}")
        return self._stack.store(key, entry)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every writable tier; ``True`` if any had it."""
        validate_key(key)
        removed = False
        for tier in self.tiers:
            if tier.read_only:
                continue
            try:
                removed = tier.delete(key) or removed
            except StoreError:
                continue
            except Exception as exc:  # the tier boundary: see tiers.unexpected
                unexpected(tier, exc)
        return removed

    def get_or_compile(
        self,
        key: str,
        fn: Callable[[], Entry | bytes],
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Entry:
        """The cached entry for ``key``, compiling it with ``fn`` on a miss.

        Single-flight: of the threads, processes (and, with a remote tier,
        machines) asking for a missing key at once, one runs ``fn`` and the
        others wait for its entry, each at most ``timeout`` seconds (``inf``:
        no limit) before it compiles itself. ``fn`` returns an
        :class:`Entry` or bytes (stored as one artifact named ``"data"``);
        its duration is recorded in the entry's metadata as
        ``compile_seconds``. An exception from ``fn`` reaches the caller that
        ran it, the waiters try again, and nothing is cached. ``fn`` asking
        for its own key raises ``RuntimeError`` at once. See
        :mod:`kernelcache.singleflight`.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        entry = self.get(key)
        if entry is not None:
            return entry
        with self.claim(key, timeout=timeout) as claim:
            if claim.entry is not None:
                return claim.entry
            return claim.compile(fn)

    def claim(self, key: str, *, timeout: float = DEFAULT_TIMEOUT) -> Claim:
        """Wait for another compile of ``key`` (thread, process or machine), or lead it.

        For compiles that do not fit in one function call. The returned
        :class:`~kernelcache.singleflight.Claim` either holds the entry that
        another compile published meanwhile (``claim.entry``), or the right
        to compile: then :meth:`Claim.publish` the result, or
        :meth:`Claim.abandon` (leaving a ``with`` block abandons), so that
        the others stop waiting. Call it after a :meth:`get` that missed.
        """
        validate_key(key)
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        return self._flight.claim(key, float(timeout))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: counters since this process opened it, plus current usage."""
        out: dict[str, dict[str, Any]] = {}
        saved = self._stats.local()[0]
        for index, (name, tier) in enumerate(zip(self._stats.names, self.tiers, strict=True)):
            info = tier.stats()
            try:
                info["entries"], info["bytes"] = tier.usage()
            except StoreError:
                info["entries"], info["bytes"] = None, None
            info["max_bytes"] = tier.max_bytes
            info["seconds_saved"] = saved[index]
            out[name] = info
        return out

    def count_uncacheable(self) -> None:
        """An integration compiled something it may not cache (counted as ``uncacheable``)."""
        self._stats.count("uncacheable")

    def compile_stats(self) -> dict[str, float]:
        """This process's compiles, compile seconds, failures, single-flight waits and timeouts."""
        return self._stats.local()[1]

    @property
    def flush_errors(self) -> int:
        """Statistics batches this process could not merge into the directory (lost, counted)."""
        return self._stats.flush_errors

    def flush_stats(self) -> None:
        """Merge the statistics counted so far into the cache directory now."""
        self._stats.flush()

    def close(self) -> None:
        self._finalizer()  # a last flush, once
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
