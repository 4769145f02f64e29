"""Listing the Redis tier: SCAN node by node, never KEYS (it blocks a server for its
whole keyspace), and describe each entry from a few bytes of its record."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

from kernelcache.errors import CorruptEntry
from kernelcache.stores.base import EntryInfo
from kernelcache.stores.redis import format as fmt
from kernelcache.stores.redis.guard import Guard
from kernelcache.stores.redis.layout import Layout

_SCAN_COUNT = 1000
Node = tuple[str | None, Any]


def keys(guard: Guard, layout: Layout) -> Iterator[tuple[Node, list[str]]]:
    """Batches of cache keys with the node that holds them (a snapshot, as SCAN gives)."""
    for node in guard.nodes():
        cursor = 0
        while True:
            cursor, names = guard.call(_page(node[1], cursor, layout.entry_pattern), node=node[0])
            yield node, [k for k in map(layout.key_of, names) if k is not None]
            if cursor == 0:
                break


def _page(client: Any, cursor: int, pattern: str) -> Any:
    return lambda _main: client.scan(cursor, pattern, _SCAN_COUNT)


def infos(guard: Guard, layout: Layout) -> Iterator[EntryInfo]:
    """Size, access time and kind of every entry, from the last bytes of each record."""
    for node, batch in keys(guard, layout):
        names = [layout.entry(key) for key in batch]
        replies = guard.pipeline(_describe(names), raise_on_error=False, node=node)
        now = time.time()
        for i, key in enumerate(batch):
            info = _entry_info(key, now, *replies[3 * i : 3 * i + 3])
            if info is not None:
                yield info


def _describe(names: list[str]) -> Any:
    def build(pipe: Any) -> None:
        for name in names:  # OBJECT IDLETIME first: the reads after it reset the idle clock
            pipe.object("idletime", name)
            pipe.getrange(name, -fmt.SUFFIX_BYTES, -1)
            pipe.strlen(name)

    return build


def info(guard: Guard, layout: Layout, key: str) -> EntryInfo | None:
    """The :func:`infos` row of one entry, or ``None``."""
    replies = guard.pipeline(
        _describe([layout.entry(key)]), raise_on_error=False, key=layout.entry(key)
    )
    return _entry_info(key, time.time(), *replies)


def fingerprint(value: bytes | bytearray) -> str:
    """What identifies one record (its last bytes hold its MAC or its artifacts' end
    and its trailer): a writer that replaces it changes them."""
    return hashlib.sha1(value[-fmt.SUFFIX_BYTES :], usedforsecurity=False).hexdigest()


def _entry_info(key: str, now: float, idle: Any, suffix: Any, strlen: Any) -> EntryInfo | None:
    if not isinstance(suffix, bytes) or not suffix:
        return None  # gone since the SCAN, or not a string
    try:
        flags, size, manifest = fmt.peek(suffix)
    except CorruptEntry:
        return None  # not one of ours: neither listed nor touched
    stored = int(strlen) + (manifest.stored if manifest else 0)
    last_access = now - idle if isinstance(idle, int) else 0.0  # no IDLETIME under LFU policies
    extra: dict[str, Any] = {
        "packed_size": size,
        "compressed": bool(flags & fmt.ZSTD),
        "signed": bool(flags & fmt.SIGNED),
        "fingerprint": fingerprint(suffix),
    }
    if manifest:
        extra["chunks"] = manifest.chunks
    return EntryInfo(key, stored, last_access, extra=extra)
