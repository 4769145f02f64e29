"""Maintenance over a Cache's tiers: list, verify, prune, clear, export and import.

What ``kernelcache ls|verify|prune|clear|export|import`` do, as functions of
the public tier API (``scan``, ``check``, ``remove_if_unchanged``, ``get``,
``put``), so the command line sees exactly the tiers, caps and read-only
flags that a user's ``Cache()`` sees. Tiers that live in this process (the
memory tier) hold nothing another process could list, and are skipped.

Every removal is stat-guarded where the tier can tell (the disk tier):
an entry another process publishes while a command runs is never removed
by mistake.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kernelcache.errors import StoreError
from kernelcache.stores.base import Damage, EntryInfo, Store, check_caps

#: ``progress(done, total)``: called as a long command advances.
Progress = Callable[[int, int], None]


def _quiet(done: int, total: int) -> None:
    """The default progress report: none."""


def persistent(tiers: Sequence[Store]) -> list[Store]:
    """The tiers other processes can see (every tier but in-process ones)."""
    return [tier for tier in tiers if not tier.in_process]


def entries(tiers: Sequence[Store]) -> Iterator[tuple[Store, EntryInfo]]:
    """Every entry of every persistent tier, with its tier; a failing tier is skipped."""
    for tier in persistent(tiers):
        try:
            infos = list(tier.scan())
        except StoreError:
            continue  # counted by the tier; the others are still listed
        for info in infos:
            yield tier, info


def verify(tiers: Sequence[Store], *, fix: bool, progress: Progress = _quiet) -> list[Damage]:
    """Check every entry; with ``fix``, remove the damaged ones from writable tiers."""
    listed = list(entries(tiers))
    damaged: list[Damage] = []
    for done, (tier, info) in enumerate(listed, 1):
        damage = tier.check(info)
        if damage is not None:
            if fix and not tier.read_only:
                damage.removed = tier.remove_if_unchanged(damage.info)
            damaged.append(damage)
        progress(done, len(listed))
    return damaged


@dataclass
class Pruned:
    """What :func:`prune` did to one tier."""

    removed: int = 0
    freed: int = 0
    kept: int = 0
    kept_bytes: int = 0


def prune(
    tier: Store,
    *,
    max_bytes: int | None = None,
    max_entries: int | None = None,
    older_than: float | None = None,
    progress: Progress = _quiet,
    dry_run: bool = False,
) -> Pruned:
    """Remove least recently used entries of ``tier`` until every given limit holds.

    ``older_than`` (seconds): also remove every entry unused that long.
    Sizes are what the tier counts against its cap (:attr:`EntryInfo.size`).
    Caps are positive or ``None``, as everywhere: a cap of 0 is a ``ValueError``
    (it would empty the tier; :meth:`Store.clear` says so plainly). ``dry_run``:
    remove nothing, report what would go.
    """
    check_caps(max_bytes, max_entries)
    infos = sorted(tier.scan(), key=lambda i: i.last_access)  # least recently used first
    now = time.time()
    total = sum(i.size for i in infos)
    victims: list[EntryInfo] = []
    for position, info in enumerate(infos):
        if not (
            (older_than is not None and now - info.last_access > older_than)
            or (max_bytes is not None and total > max_bytes)
            or (max_entries is not None and len(infos) - position > max_entries)
        ):
            break  # the rest are newer and the limits hold
        victims.append(info)
        total -= info.size
    result = Pruned()
    for done, info in enumerate(victims, 1):
        if dry_run or tier.remove_if_unchanged(info):
            result.removed += 1
            result.freed += info.size
        progress(done, len(victims))
    result.kept = len(infos) - result.removed
    result.kept_bytes = sum(i.size for i in infos) - result.freed
    return result


def find(tiers: Sequence[Store], key: str) -> tuple[Store, EntryInfo] | None:
    """The first persistent tier holding ``key``, with the entry's info."""
    for tier in persistent(tiers):
        try:
            info = tier.info(key)
        except StoreError:
            continue
        if info is not None:
            return tier, info
    return None
