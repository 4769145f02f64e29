"""The Cache: tiers composed, read-through with promotion, failures as misses."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.settings import Settings
from kernelcache.stores.base import Store, validate_key


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
        DiskStore(settings.dir, max_bytes=settings.max_size, read_only=settings.readonly),
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
    """

    def __init__(
        self, tiers: Sequence[Store] | None = None, *, settings: Settings | None = None
    ) -> None:
        self.settings = settings if settings is not None else Settings.load()
        self.tiers: list[Store] = list(default_tiers(self.settings) if tiers is None else tiers)
        for tier in self.tiers:
            if not isinstance(tier, Store):
                raise TypeError(f"Cache tiers must be Store instances, not {type(tier).__name__}")

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
                if index:
                    self._write(self.tiers[:index], key, entry)
                return entry
        return None

    def put(self, key: str, entry: Entry) -> None:
        """Store ``entry`` in every writable tier; failing tiers are skipped and counted."""
        validate_key(key)
        if not isinstance(entry, Entry):
            raise TypeError(f"Cache.put takes an Entry, not {type(entry).__name__}")
        entry.key = key
        self._write(self.tiers, key, entry)

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

    def get_or_compile(self, key: str, compile: Callable[[], Entry | bytes]) -> Entry:
        """The cached entry for ``key``, compiling and storing it on a miss.

        ``compile`` returns an :class:`Entry` or bytes (stored as one artifact
        named ``"data"``). Its duration is recorded in the entry's metadata as
        ``compile_seconds``. Exceptions from ``compile`` propagate and nothing
        is cached.
        """
        entry = self.get(key)
        if entry is not None:
            return entry
        start = time.perf_counter()
        result = compile()
        elapsed = time.perf_counter() - start
        entry = _as_entry(result).with_meta(compile_seconds=round(elapsed, 6))
        self.put(key, entry)
        return entry

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: counters since this process opened it, plus current usage."""
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            name = tier.kind
            suffix = 2
            while name in out:
                name, suffix = f"{tier.kind}{suffix}", suffix + 1
            info = tier.stats()
            try:
                info["entries"], info["bytes"] = tier.usage()
            except StoreError:
                info["entries"], info["bytes"] = None, None
            info["max_bytes"] = tier.max_bytes
            out[name] = info
        return out

    def close(self) -> None:
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


def _as_entry(result: Entry | bytes | bytearray | memoryview) -> Entry:
    if isinstance(result, Entry):
        return result
    if isinstance(result, (bytes, bytearray, memoryview)):
        return Entry({"data": result})
    raise TypeError(
        f"the compile function must return an Entry or bytes, not {type(result).__name__}"
    )
