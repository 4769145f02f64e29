"""The database-file side of the SQLite tier: opening, schema, recovery, forks.

:class:`SQLiteFile` owns the connection to one SQLite database (WAL) and keeps
it fit for use; :class:`~kernelcache.stores.sqlite.SQLiteStore` builds the
entries on it. Schema (``application_id`` "KCSQ", ``user_version`` 1)::

    entries(key TEXT PRIMARY KEY, data BLOB, size INTEGER, created REAL, last_access REAL)
    meta(name TEXT PRIMARY KEY, value INTEGER)  -- running totals 'bytes' and 'entries'

A corrupt or foreign file is moved aside under ``<path>.lock`` (an flock), a
file replaced by another process is reopened, and a connection inherited
through ``fork`` is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from kernelcache import _trust
from kernelcache.errors import StoreError
from kernelcache.stores.base import Store
from kernelcache.stores.lockfile import close_lock_fd, lock_within, open_lock_fd

APPLICATION_ID = 0x4B435351  # "KCSQ": tells our database from any other SQLite file
SCHEMA_VERSION = 1
#: Seconds a statement waits for another connection's lock before failing.
DEFAULT_TIMEOUT = 10.0
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


class SQLiteFile(Store):
    """A store kept in one SQLite file: the connection and what keeps it usable.

    One connection per object, serialised by a lock and opened on first use
    (a writable store creates or recovers the file at once unless ``open_now``
    is false; a failure to open is then a counted error on first use). A corrupt or
    foreign file is moved aside to ``<path>.corrupt-<n>`` (with its
    ``-wal``/``-shm``), counted in ``counters.corrupt``, and a fresh one
    started; a read-only store reports it as an error and leaves it. Subclasses
    run their statements through :meth:`_call`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        read_only: bool,
        timeout: float | None,
        durable: bool,
        open_now: bool = True,
    ) -> None:
        super().__init__(read_only=read_only)
        self.path = os.path.abspath(os.fspath(path))
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
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
        if open_now and not read_only:
            self._call(lambda conn: None)  # create or recover the file now, not on first use

    # Connection management ---------------------------------------------
    def _connection(self) -> sqlite3.Connection | None:
        """The open connection (opening it if needed); ``None``: read-only and no file."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> sqlite3.Connection | None:
        _check_directory(os.path.dirname(self.path), create=not self.read_only)
        if self.read_only:
            return self._open_read_only()
        with _file_lock(self.path + ".lock", self.timeout):
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
                with transaction(conn):
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
        with _file_lock(self.path + ".lock", self.timeout):
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
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
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


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def _file_lock(path: str, timeout: float) -> Iterator[None]:
    """An exclusive flock on ``path``, released by the OS if this process dies.

    Waits at most ``timeout`` seconds (the store's, as for the database's own
    lock), then raises ``TimeoutError``: a process that holds the lock and
    hangs must not hang every other one.
    """
    fd = open_lock_fd(path)  # never through a symlink
    if not lock_within(fd, timeout):
        raise TimeoutError(f"{path} is held by another process for over {timeout} s")
    try:
        yield
    finally:
        close_lock_fd(fd)


def _check_directory(folder: str, create: bool) -> None:
    """Refuse a folder that someone else could change (:mod:`kernelcache._trust`); make it if asked.

    Raised as ``PermissionError``: the store counts it and the Cache sees a
    miss, as for any tier that cannot be used.
    """
    try:
        fd = _trust.open_dir(folder, create=create)
    except _trust.UntrustedDirectory as exc:
        raise PermissionError(errno.EPERM, f"refusing {exc}") from None
    if fd is not None:
        os.close(fd)
