"""The Cache: tiers composed, read-through with promotion, failures as misses."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from kernelcache import singleflight
from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.settings import Settings
from kernelcache.stats import Recorder, persistent_dir
from kernelcache.stores.base import Store, validate_key

#: How long a caller waits for another's compile of the same key before compiling itself.
DEFAULT_TIMEOUT = 300.0


def default_tiers(settings: Settings) -> list[Store]:
    """Memory, local disk, and Redis when ``remote`` is set, as :class:`Settings` say.

    The remote tier is read-only when ``readonly`` is set or its URL says ``?readonly=1``.
    """
    from kernelcache.stores.disk import DiskStore
    from kernelcache.stores.memory import MemoryStore

    if settings.disable:
        return []
    tiers: list[Store] = [
        MemoryStore(max_bytes=settings.memory_max_size),
        DiskStore.from_settings(settings),
    ]
    if settings.remote:
        from kernelcache.stores.redis import RedisStore  # only users of a remote pay for it

        tiers.append(
            RedisStore(settings.remote, secret=settings.secret, read_only=settings.readonly)
        )
    return tiers


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
        self._flights = singleflight.Flights()
        self._stats = Recorder(self.tiers, persistent_dir(self.tiers) if persist_stats else None)
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
            if entry is not None:
                if index or self._exact_first:
                    self._hit(index, key, entry)
                else:
                    self._sample.append(key)  # a memory hit: stats cost one append
                return entry
        self._stats.tick()
        return None

    def _hit(self, index: int, key: str, entry: Entry) -> None:
        """Promote a hit to the tiers above ``index`` and count it."""
        self._write(self.tiers[:index], key, entry)
        self._stats.hit(index, key, entry)

    def put(self, key: str, entry: Entry) -> None:
        """Store ``entry`` in every writable tier; failing tiers are skipped and counted."""
        validate_key(key)
        if not isinstance(entry, Entry):
            raise TypeError(f"Cache.put takes an Entry, not {type(entry).__name__}")
        entry.key = key
        self._write(self.tiers, key, entry)
        self._stats.note(key, entry)
        self._stats.tick()

    @staticmethod
    def _write(tiers: Sequence[Store], key: str, entry: Entry) -> None:
        for tier in tiers:
            if tier.read_only:
                continue
            try:
                tier.put(key, entry)
            except StoreError:
                continue  # counted by the tier; the others still get the entry

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
        others wait for its entry, each at most ``timeout`` seconds before it
        compiles itself. ``fn`` returns an :class:`Entry` or bytes (stored as
        one artifact named ``"data"``); its duration is recorded in the
        entry's metadata as ``compile_seconds``. An exception from ``fn``
        reaches the caller that ran it, the waiters try again, and nothing is
        cached. See :mod:`kernelcache.singleflight`.
        """
        validate_key(key)
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
        return singleflight.get_or_compile(self, key, fn, float(timeout))

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

    def compile_stats(self) -> dict[str, float]:
        """This process's compiles, compile seconds, failures, single-flight waits and timeouts."""
        return self._stats.local()[1]

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
