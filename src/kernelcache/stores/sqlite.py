"""Single-file tier: entries in one SQLite database (WAL), LRU by last access, capped.

For filesystems short of inodes and caches of many small entries. Schema
(``application_id`` "KCSQ", ``user_version`` 1)::

    entries(key TEXT PRIMARY KEY, data BLOB, size INTEGER, created REAL, last_access REAL)
    meta(name TEXT PRIMARY KEY, value INTEGER)  -- running totals 'bytes' and 'entries'

``data`` is the packed entry (kernelcache.entry format), verified on every read.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import EntryInfo, Store, validate_key

APPLICATION_ID = 0x4B435351  # "KCSQ": tells our database from any other SQLite file
SCHEMA_VERSION = 1
#: A hit refreshes the entry's last_access (its LRU clock) at most this often,
#: so hits stay reads instead of each taking the database's write lock.
TOUCH_INTERVAL = 60.0
#: Seconds a statement waits for another connection's lock before failing.
DEFAULT_TIMEOUT = 10.0
_EVICT_BATCH = 64
# Result codes (low byte of the extended code) meaning the file itself is bad.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
_SCHEMA = (
    "CREATE TABLE entries (key TEXT PRIMARY KEY, data BLOB NOT NULL, size INTEGER NOT NULL,"
    " created REAL NOT NULL, last_access REAL NOT NULL)",
    "CREATE INDEX entries_lru ON entries (last_access)",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT INTO meta VALUES ('bytes', 0), ('entries', 0)",
    f"PRAGMA application_id = {APPLICATION_ID}",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)
_T = TypeVar("_T")
log = logging.getLogger("kernelcache")


class _BadFile(Exception):
    """The database file is corrupt, not SQLite, or another program's schema."""


class SQLiteStore(Store):
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
        max_bytes: int | None = None,
        max_entries: int | None = None,
        *,
        read_only: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        durable: bool = False,
    ) -> None:
        super().__init__(read_only=read_only)
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.timeout = timeout
        self.durable = durable
        #: Where damaged database files were moved by this object.
        self.moved_aside: list[str] = []
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._file_id: tuple[int, int] | None = None
        self._pid = os.getpid()
        # Connections inherited through fork are never used or closed in the child:
        # SQLite forbids both, and closing may checkpoint the parent's WAL.
        self._inherited: list[sqlite3.Connection] = []
        if not read_only:
            self._call(lambda conn: None)  # create or recover the file now, not on first use

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # Connection management ---------------------------------------------
    def _connection(self) -> sqlite3.Connection | None:
        """The open connection (opening it if needed); ``None``: read-only and no file."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> sqlite3.Connection | None:
        if self.read_only:
            return self._open_read_only()
        parent = os.path.dirname(self.path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        with _file_lock(self.path + ".lock"):
            try:
                conn = self._connect_checked()
            except _BadFile as exc:
                self._move_aside(str(exc))
                conn = self._connect_checked()
        self._file_id = _file_id(self.path)
        return conn

    def _open_read_only(self) -> sqlite3.Connection | None:
        if not os.path.exists(self.path):
            return None  # nothing stored yet: every read is a miss
        conn = sqlite3.connect(
            f"file:{self.path}?mode=ro", uri=True, timeout=self.timeout,
            isolation_level=None, check_same_thread=False,
        )  # fmt: skip
        try:
            if _inspect(conn) != "ours":  # read-only: reported (and counted), never moved
                raise _BadFile(f"{self.path} is not a kernelcache database (opened read-only)")
        except BaseException:
            conn.close()
            raise
        self._file_id = _file_id(self.path)
        return conn

    def _connect_checked(self) -> sqlite3.Connection:
        """Connect, check the file is ours (or empty: create the schema); under the open lock."""
        if not os.path.exists(self.path):
            # Private to the user; SQLite gives -wal and -shm the same mode.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        conn = sqlite3.connect(
            self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            state = _inspect(conn)
            if state == "foreign":
                raise _BadFile("foreign database or schema mismatch")
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
            if state == "empty":
                with _transaction(conn):
                    for statement in _SCHEMA:
                        conn.execute(statement)
        except sqlite3.DatabaseError as exc:
            conn.close()
            if _is_corruption(exc):
                raise _BadFile(str(exc)) from exc
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self, why: str) -> None:
        """Rename the bad file (and its WAL) to ``<path>.corrupt-<n>``; under the open lock."""
        n = 1
        while os.path.exists(f"{self.path}.corrupt-{n}"):
            n += 1
        target = f"{self.path}.corrupt-{n}"
        os.rename(self.path, target)
        for suffix in ("-wal", "-shm", "-journal"):
            # A fresh database must not replay the old file's WAL.
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path + suffix, target + suffix)
        self._count("corrupt")
        self.moved_aside.append(target)
        log.warning("kernelcache: %s is unusable (%s); moved to %s", self.path, why, target)

    def _recover(self) -> None:
        """After corruption showed mid-operation: move the file aside unless another
        process already did, and reopen."""
        self._drop_connection()
        with _file_lock(self.path + ".lock"):
            if _file_id(self.path) == self._file_id:
                self._move_aside("corrupt")
            else:
                self._count("corrupt")  # another process replaced it already
        self._conn = self._open()

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def _replaced(self) -> bool:
        """Whether the file we have open is no longer at ``path`` (moved aside or deleted)."""
        return self._file_id is not None and _file_id(self.path) != self._file_id

    def _call(self, op: Callable[[sqlite3.Connection | None], _T], *, write: bool = False) -> _T:
        """Run ``op`` with the connection; backend errors become a counted StoreError.

        A corrupt database is moved aside and ``op`` runs once more on a fresh one,
        so a put still stores the user's compile.
        """
        if self._pid != os.getpid():  # forked: the parent's connection and lock are not ours
            if self._conn is not None:
                self._inherited.append(self._conn)
            self._conn, self._pid, self._lock = None, os.getpid(), threading.RLock()
        with self._lock:
            try:
                if write and self._conn is not None and self._replaced():
                    self._drop_connection()
                conn = self._connection()
                try:
                    return op(conn)
                except sqlite3.DatabaseError as exc:
                    if conn is None or self.read_only or not _is_corruption(exc):
                        raise  # a read-only store never moves the file: an error, a miss
                    self._recover()
                    return op(self._conn)
            except (sqlite3.Error, OSError, _BadFile) as exc:
                self._count("errors")
                raise StoreError(f"sqlite tier {self.path}: {exc}") from exc

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
    def put(self, key: str, entry: Entry) -> None:
        validate_key(key)
        self._check_writable()
        blob = entry.pack(key)
        evicted = self._call(lambda conn: self._insert(conn, key, blob), write=True)
        self._count("puts")
        self._count("bytes_written", len(blob))
        if evicted:
            self._count("evictions", evicted)

    def _insert(self, conn: sqlite3.Connection | None, key: str, blob: bytes) -> int:
        assert conn is not None
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            # It cannot be kept: evicting everything else to make room would not help.
            self._delete_row(conn, key)
            return 1
        now = time.time()
        with _transaction(conn):
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
        with _transaction(conn):
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
            with _transaction(conn):
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

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._drop_connection()
            elif self._conn is not None:  # the parent's: never closed here (see __init__)
                self._inherited.append(self._conn)
            self._conn = None
            super().close()


# Helpers -------------------------------------------------------------------
def _inspect(conn: sqlite3.Connection) -> str:
    """``"ours"``, ``"empty"`` (a new file) or ``"foreign"``; raises on a non-SQLite file."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if app_id == APPLICATION_ID and version == SCHEMA_VERSION:
        return "ours"
    tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    return "empty" if (app_id, version, tables) == (0, 0, 0) else "foreign"


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """Whether ``exc`` says the file is damaged or not a database (not busy, not I/O)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    return type(exc) is sqlite3.DatabaseError  # how 3.10 reports CORRUPT and NOTADB


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any error (the write lock is taken up front,
    so a busy database fails at BEGIN, not half-way)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _totals(conn: sqlite3.Connection) -> tuple[int, int]:
    rows = dict(conn.execute("SELECT name, value FROM meta").fetchall())
    return int(rows["bytes"]), int(rows["entries"])


def _set_totals(conn: sqlite3.Connection, total_bytes: int, total_entries: int) -> None:
    conn.executemany(
        "UPDATE meta SET value = ? WHERE name = ?",
        ((total_bytes, "bytes"), (total_entries, "entries")),
    )


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive flock on ``path``, released by the OS if this process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
