"""The stored entries nearest to a key record: same namespace (and name), fewest differing fields."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.explain.words import differences, distance

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from kernelcache.entry import Entry
    from kernelcache.stores.base import Store

__all__ = ["SCAN_MAX", "nearest", "stored_record"]

#: Entries read at most per tier to find the nearest (a listing, not a hit path).
SCAN_MAX = 20_000


def stored_record(tiers: Sequence[Store], key: str) -> dict[str, Any] | None:
    """The key record kept with the entry stored under ``key``, from the first tier holding it."""
    for tier in tiers:
        try:
            entry = tier.get(key)
            if entry is not None:
                return _record_of(key, entry)
        except (StoreError, CorruptEntry):
            continue
    return None


def _record_of(key: str, entry: Entry) -> dict[str, Any] | None:
    """The entry's key record with its key and name; ``CorruptEntry`` for bad metadata."""
    record = entry.key_record
    if record is None or not isinstance(record.get("fields"), list):
        return None
    return {"key": key, "name": entry.meta.get("name"), **record}


def _stored(tiers: Sequence[Store]) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    for tier in tiers:
        if tier.in_process:
            continue
        try:
            keys = list(itertools.islice(tier.keys(), SCAN_MAX))
        except StoreError:
            continue
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            try:
                entry = tier.get(key)
                record = None if entry is None else _record_of(key, entry)
            except (StoreError, CorruptEntry):
                continue
            if record is not None:
                yield record


def nearest(tiers: Sequence[Store], record: dict[str, Any], count: int = 3) -> list[dict[str, Any]]:
    """Up to ``count`` stored records of ``record``'s namespace nearest to it, each with its
    ``differences`` (in words); entries of the same name first when ``record`` has one."""
    name = record.get("name")
    found = []
    for other in _stored(tiers):
        if other["key"] == record.get("key") or other.get("ns") != record.get("ns"):
            continue
        found.append((other.get("name") != name, distance(record, other), other))
    found.sort(key=lambda item: (item[0], item[1]))
    out = []
    for _, _, other in found[:count]:
        said = differences(record, other)
        out.append(
            {
                "key": other["key"],
                "name": other.get("name"),
                "differing": len(said),
                "differences": said,
            }
        )
    return out
