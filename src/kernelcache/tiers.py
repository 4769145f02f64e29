"""Tiers composed: read-through with promotion, write-through, failures as counted misses.

:class:`TierStack` is what a :class:`~kernelcache.Cache` and its single-flight
share: looking in the tiers from a given index (promoting and counting a hit)
and storing an entry in every writable tier. :func:`default_tiers` builds the
tiers that :class:`~kernelcache.settings.Settings` describe.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

from kernelcache import _trust, fstype
from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.settings import Settings
from kernelcache.stats import Recorder
from kernelcache.stores.base import Store
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

#: The SQLite tier's file under the cache directory (``KERNELCACHE_LOCAL=sqlite``).
SQLITE_FILE = "cache.sqlite"
#: (tier class, exception class) pairs already warned about by :func:`unexpected`.
_WARNED: set[tuple[type, type]] = set()


def unexpected(tier: Store, exc: Exception) -> None:
    """A tier raised something other than :class:`StoreError` (a bug, a misconfigured
    client, a third-party tier): counted as the tier's error and said once per kind,
    never raised from ``Cache.get``/``put`` (issue 20: a ``TypeError`` from redis-py
    broke every build)."""
    with contextlib.suppress(TypeError, AttributeError):  # a tier without our counters
        tier.counters.add("errors")
    kind = (type(tier), type(exc))
    if kind not in _WARNED:
        _WARNED.add(kind)
        logging.getLogger("kernelcache").warning(
            "kernelcache: %r failed with %s: %s; counted as a miss (said once)",
            tier,
            type(exc).__name__,
            exc,
        )


def default_tiers(settings: Settings) -> list[Store]:
    """Memory, a local tier, and the team tiers ``remote`` lists, as :class:`Settings` say.

    The local tier is a :class:`DiskStore` at ``dir`` or, with ``local="sqlite"``,
    a :class:`SQLiteStore` at ``dir/cache.sqlite``; both take ``max_size`` as
    their cap (``max_bytes``). The remote tier is read-only when ``read_only`` is set or its URL
    says ``?readonly=1``.
    """
    if settings.disable:
        return []
    fstype.warn_if_network(settings.dir)  # once per process: a library user, not each nvcc call
    tiers: list[Store] = [MemoryStore(max_bytes=settings.memory_max_bytes), local_tier(settings)]
    if settings.remote:
        from kernelcache.stores import remotes  # only users of a remote pay for it

        team = [  # front first: Redis before S3
            remotes.make(url, secret=settings.secret, read_only=settings.read_only)
            for url in remotes.split(settings.remote)
        ]
        remotes.share_leases(team)
        tiers.extend(team)
    return tiers


def settings_dir(settings: Settings, tiers: Sequence[Store] = ()) -> str | None:
    """Where a Cache over the default tiers keeps its statistics.

    None when disabled, and when the directory is not safe (someone else's,
    or writable by others: the disk tier refuses it too). A read-only Cache
    reads them there but records nothing (see :class:`~kernelcache.Cache`).
    ``tiers``: the Cache's own; a disk tier among them that opened the
    directory for writing has walked it already (one trust walk per Cache).
    """
    if settings.disable:
        return None
    where = os.path.abspath(settings.dir)
    if any(isinstance(t, DiskStore) and t.local_dir == where for t in tiers):
        return settings.dir
    # Missing (with trusted ancestors) is fine: whoever makes it makes it private.
    return settings.dir if _trust.refusal(settings.dir) is None else None


def local_tier(settings: Settings) -> Store:
    """The one local tier :class:`Settings` describe (see :func:`default_tiers`)."""
    if settings.local == "sqlite":
        from kernelcache.stores.sqlite import SQLiteStore  # sqlite3 only for its users

        # Opened on first use: a database locked past its timeout or unreadable
        # now costs a counted miss per use, never Cache() itself.
        return SQLiteStore(
            os.path.join(settings.dir, SQLITE_FILE),
            max_bytes=settings.max_bytes,
            read_only=settings.read_only,
            open_now=False,
        )
    return DiskStore.from_settings(settings)


class TierStack:
    """Reads and writes over an ordered sequence of tiers (fastest first).

    A tier that raises :class:`StoreError` is skipped: it counted the failure
    itself, and the other tiers still serve or store the entry.
    """

    def __init__(self, tiers: Sequence[Store], recorder: Recorder) -> None:
        self.tiers = tiers
        self.recorder = recorder

    def hit(self, index: int, key: str, entry: Entry) -> Entry:
        """Count a hit in ``tiers[index]`` and promote it to the faster tiers.

        Returns the entry to hand out: as the fastest tier holding files keeps
        it (a Redis hit promoted to disk gives ``path()`` files on disk).
        """
        self.recorder.hit(index, key, entry)
        return self.write(self.tiers[:index], key, entry)

    def lookup_from(self, start: int, key: str) -> Entry | None:
        """Look again in ``tiers[start:]`` (single-flight, after a lock wait).

        The first lookup already counted this request's miss, so a miss here
        is taken back from the tier's counters rather than counted twice.
        """
        for index in range(start, len(self.tiers)):
            tier = self.tiers[index]
            try:
                entry = tier.get(key)
            except StoreError:
                continue
            except Exception as exc:  # the tier boundary: see unexpected
                unexpected(tier, exc)
                continue
            if entry is not None:
                return self.hit(index, key, entry)
            tier.counters.add("misses", -1)
        return None

    def store(self, key: str, entry: Entry) -> Entry:
        """Write ``entry`` under ``key`` to every writable tier; returns it as stored.

        The entry carries its key's fields when this process built the key
        (:func:`kernelcache.explain.record.stamp`; a put, never a hit, pays for it).
        """
        from kernelcache.explain.record import stamp

        entry = stamp(key, entry, self.recorder.directory)
        stored = self.write(self.tiers, key, entry if entry.key == key else entry.bind(key))
        self.recorder.note(key, stored)
        self.recorder.tick()
        return stored

    @staticmethod
    def write(tiers: Sequence[Store], key: str, entry: Entry) -> Entry:
        """Write ``entry`` to ``tiers``, slowest first: what a tier with files of its
        own returns (``path()`` inside it) is what the faster tiers keep."""
        for tier in reversed(tiers):
            if tier.read_only:
                continue
            try:
                entry = tier.put(key, entry)
            except StoreError:
                continue  # counted by the tier; the others still get the entry
            except Exception as exc:  # the tier boundary: see unexpected
                unexpected(tier, exc)
        return entry
