"""Single-file tier: entries in one SQLite database (WAL), LRU by last access, capped.

For filesystems short of inodes and caches of many small entries. The table
``entries`` holds each packed entry (kernelcache.entry format), verified on
every read; ``meta`` keeps the running totals the caps are checked against.
Opening the file, its schema and recovery from a damaged one are in
:mod:`kernelcache.stores.sqlite.file`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry
from kernelcache.stores.base import EntryInfo, bound, check_caps, validate_key
from kernelcache.stores.sqlite.file import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    SQLiteFile,
    transaction,
)

# The format constants stay importable from here, where the tier is documented.
__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "TOUCH_INTERVAL", "SQLiteStore"]

#: A hit refreshes the entry's last_access (its LRU clock) at most this often,
#: so hits stay reads instead of each taking the database's write lock.
TOUCH_INTERVAL = 60.0
_EVICT_BATCH = 64


class SQLiteStore(SQLiteFile):
    """Entries in one SQLite file, shared safely by threads and processes.

    Concurrency: one connection per store object, serialised by a lock; other
    processes wait up to ``timeout`` seconds for the database's write lock, and
    a lock still held after that is a :class:`StoreError` (a miss for the
    Cache), never a reset. Each put, delete and eviction is one transaction, so
    readers see a complete entry or none, whatever happens to writers (SIGKILL
    included). Not power-loss durable unless ``durable=True`` (synchronous=FULL).

    Caps: ``max_bytes`` (packed entry bytes) and ``max_entries`` hold exactly:
    each put evicts least recently used entries in its own transaction. The
    file itself is larger by SQLite's page overhead, keeps freed pages for
    reuse (no VACUUM), and its ``-wal`` file grows by up to ~4 MiB between
    checkpoints. An entry larger than ``max_bytes`` is not kept.

    A corrupt or foreign database file is moved aside to ``<path>.corrupt-<n>``
    (with its ``-wal``/``-shm``) and a fresh one started; ``counters.corrupt``
    counts it. ``<path>.lock`` serialises opening and recovery between processes.
    """

    kind = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        read_only: bool = False,
        timeout: float | None = None,
        durable: bool = False,
        open_now: bool = True,
    ) -> None:
        check_caps(max_bytes, max_entries)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        super().__init__(
            path, read_only=read_only, timeout=timeout, durable=durable, open_now=open_now
        )

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # Reads -------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        validate_key(key)  # a key is only ever a bound parameter, but keep one contract
        row = self._call(lambda conn: self._select(conn, key))
        if row is None:
            self._count("misses")
            return None
        data, last_access = row
        try:
            entry = Entry.unpack(data, key)
        except CorruptEntry:
            self._count("corrupt")
            self._count("misses")
            if not self.read_only:
                self._call(lambda conn: self._delete_row(conn, key, data), write=True)
            return None
        if not self.read_only and time.time() - last_access > TOUCH_INTERVAL:
            self._call(lambda conn: self._touch(conn, key))
        self._count("hits")
        self._count("bytes_read", len(data))
        return entry

    def _select(self, conn: sqlite3.Connection | None, key: str) -> tuple[bytes, float] | None:
        if conn is None:
            return None
        query = "SELECT data, last_access FROM entries WHERE key = ?"
        row = conn.execute(query, (key,)).fetchone()
        if row is None and self._replaced():
            # Another process moved our file aside (or it was deleted): read the new one.
            self._drop_connection()
            conn = self._connection()
            row = None if conn is None else conn.execute(query, (key,)).fetchone()
        return None if row is None else (row[0], row[1])

    @staticmethod
    def _touch(conn: sqlite3.Connection | None, key: str) -> None:
        assert conn is not None
        try:
            conn.execute("UPDATE entries SET last_access = ? WHERE key = ?", (time.time(), key))
        except sqlite3.OperationalError:
            # Database locked: the entry was read and verified already; the LRU
            # clock is refreshed by a later hit instead of failing this one.
            return

    # Writes ------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        blob = entry.pack(key)
        evicted = self._call(lambda conn: self._insert(conn, key, blob), write=True)
        self._count("puts")
        self._count("bytes_written", len(blob))
        if evicted:
            self._count("evictions", evicted)
        return bound(entry, key)

    def _insert(self, conn: sqlite3.Connection | None, key: str, blob: bytes) -> int:
        assert conn is not None
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            # It cannot be kept: evicting everything else to make room would not help.
            self._delete_row(conn, key)
            return 1
        now = time.time()
        with transaction(conn):
            total_bytes, total_entries = _totals(conn)
            row = conn.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            conn.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?)",
                (key, blob, len(blob), now, now),
            )
            total_bytes += len(blob) - (row[0] if row else 0)
            total_entries += 0 if row else 1
            evicted = 0
            if self._over_cap(total_bytes, total_entries):
                evicted, total_bytes, total_entries = self._evict(
                    conn, key, total_bytes, total_entries
                )
            _set_totals(conn, total_bytes, total_entries)
        return evicted

    def _over_cap(self, total_bytes: int, total_entries: int) -> bool:
        return (self.max_bytes is not None and total_bytes > self.max_bytes) or (
            self.max_entries is not None and total_entries > self.max_entries
        )

    def _evict(
        self, conn: sqlite3.Connection, keep: str, total_bytes: int, total_entries: int
    ) -> tuple[int, int, int]:
        """Delete least recently used rows, never ``keep`` (the entry just put), until
        under the caps."""
        evicted = 0
        while self._over_cap(total_bytes, total_entries):
            rows = conn.execute(
                "SELECT key, size FROM entries WHERE key != ? ORDER BY last_access, rowid LIMIT ?",
                (keep, _EVICT_BATCH),
            ).fetchall()
            if not rows:  # only the new entry is left, and it fits (put checked)
                break
            for victim, size in rows:
                if not self._over_cap(total_bytes, total_entries):
                    break
                conn.execute("DELETE FROM entries WHERE key = ?", (victim,))
                total_bytes -= size
                total_entries -= 1
                evicted += 1
        return evicted, total_bytes, total_entries

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        removed = self._call(lambda conn: self._delete_row(conn, key), write=True)
        if removed:
            self._count("deletes")
        return removed

    @staticmethod
    def _delete_row(conn: sqlite3.Connection | None, key: str, data: bytes | None = None) -> bool:
        """Delete ``key`` (only if it still holds ``data``, when given) and update the totals."""
        assert conn is not None
        with transaction(conn):
            if data is None:
                row = conn.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            else:  # a corrupt row: never remove an entry re-put meanwhile
                row = conn.execute(
                    "SELECT size FROM entries WHERE key = ? AND data = ?", (key, data)
                ).fetchone()
            if row is None:
                return False
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
            total_bytes, total_entries = _totals(conn)
            _set_totals(conn, total_bytes - row[0], total_entries - 1)
        return True

    def clear(self) -> int:
        self._check_writable()

        def op(conn: sqlite3.Connection | None) -> int:
            assert conn is not None
            with transaction(conn):
                removed = conn.execute("DELETE FROM entries").rowcount
                _set_totals(conn, 0, 0)
            return int(removed)

        return self._call(op, write=True)

    # Listing -----------------------------------------------------------
    def keys(self) -> Iterator[str]:
        return (info.key for info in self.scan())

    def scan(self) -> Iterator[EntryInfo]:
        def op(conn: sqlite3.Connection | None) -> list[EntryInfo]:
            if conn is None:
                return []
            rows = conn.execute("SELECT key, size, last_access, created FROM entries")
            return [EntryInfo(k, size, last, created) for k, size, last, created in rows]

        return iter(self._call(op))

    def usage(self) -> tuple[int, int]:
        """From the running totals: exact, kept in step with every write transaction."""
        totals = self._call(lambda conn: (0, 0) if conn is None else _totals(conn))
        return totals[1], totals[0]


# Helpers -------------------------------------------------------------------
def _totals(conn: sqlite3.Connection) -> tuple[int, int]:
    rows = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    return int(rows["bytes"]), int(rows["entries"])


def _set_totals(conn: sqlite3.Connection, total_bytes: int, total_entries: int) -> None:
    conn.executemany(
        "UPDATE meta SET value = ? WHERE name = ?",
        ((total_bytes, "bytes"), (total_entries, "entries")),
    )
