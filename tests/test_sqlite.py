"""SQLiteStore behaviour that only a database file has (the shared contract is elsewhere)."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache import Cache, Entry, ReadOnlyStoreError, StoreError
from kernelcache.stores import sqlite as sqlite_module
from kernelcache.stores.sqlite import APPLICATION_ID, SCHEMA_VERSION, SQLiteStore


def entry_of(tag: str, size: int = 3000) -> Entry:
    return Entry({"kernel.cubin": tag.encode().ljust(size, b"#")}, meta={"t": tag})


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "kc.sqlite"


@pytest.fixture
def raw() -> Iterator[list[sqlite3.Connection]]:
    """Side connections a test opens on the database; closed afterwards."""
    conns: list[sqlite3.Connection] = []
    yield conns
    for conn in conns:
        conn.close()


def connect(raw: list[sqlite3.Connection], path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=0.05)
    raw.append(conn)
    return conn


def files_next_to(path: Path) -> list[str]:
    return sorted(os.listdir(path.parent))


def test_new_database_is_private(db: Path) -> None:
    with SQLiteStore(db) as store:
        store.put("k", entry_of("k"))
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
        for name in files_next_to(db):
            assert stat.S_IMODE((db.parent / name).stat().st_mode) == 0o600, name
        assert f"{db.name}-wal" in files_next_to(db)  # WAL mode


def sqlite_header_then_garbage(n: int) -> bytes:
    return b"SQLite format 3\0" + os.urandom(n)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"not a database at all\n" * 200, id="text"),
        pytest.param(b"\x7fELF" + bytes(5000), id="binary"),
        pytest.param(sqlite_header_then_garbage(8192), id="sqlite-header-garbage"),
    ],
)
def test_non_database_file_is_moved_aside_and_a_fresh_one_started(db: Path, content: bytes) -> None:
    db.parent.mkdir(mode=0o700)
    db.write_bytes(content)
    store = SQLiteStore(db)
    assert store.moved_aside == [f"{db}.corrupt-1"]
    assert Path(f"{db}.corrupt-1").read_bytes() == content  # nothing the user had is lost
    assert store.counters.corrupt == 1
    store.put("k", entry_of("k"))
    assert store.get("k") == entry_of("k")
    store.close()
    db.write_bytes(content)  # again: the next free name
    with SQLiteStore(db) as again:
        assert again.moved_aside == [f"{db}.corrupt-2"]


def make_foreign_database(path: Path, app_id: int, version: int) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('ada')")
    conn.execute(f"PRAGMA application_id = {app_id}")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    ("app_id", "version"),
    [
        pytest.param(0, 0, id="another-program"),
        pytest.param(0x12345678, 1, id="another-application-id"),
        pytest.param(APPLICATION_ID, SCHEMA_VERSION + 1, id="newer-schema"),
        pytest.param(APPLICATION_ID, 0, id="ours-without-version"),
    ],
)
def test_foreign_or_mismatched_database_is_moved_aside_intact(
    db: Path, raw: list[sqlite3.Connection], app_id: int, version: int
) -> None:
    make_foreign_database(db, app_id, version)
    with SQLiteStore(db) as store:
        assert store.moved_aside == [f"{db}.corrupt-1"]
        store.put("k", entry_of("k"))
        assert store.get("k") == entry_of("k")
    moved = connect(raw, Path(f"{db}.corrupt-1"))
    assert moved.execute("SELECT name FROM users").fetchall() == [("ada",)]


def test_empty_file_is_initialised_in_place(db: Path) -> None:
    db.parent.mkdir(mode=0o700)
    db.write_bytes(b"")
    with SQLiteStore(db) as store:
        assert store.moved_aside == []
        store.put("k", entry_of("k"))
    with SQLiteStore(db) as reopened:
        assert reopened.get("k") == entry_of("k")
        assert reopened.counters.corrupt == 0


def corrupt_pages_after_the_first(path: Path) -> None:
    """Damage every page but the header page: opening works, reading entries fails."""
    data = bytearray(path.read_bytes())
    data[4096:] = os.urandom(len(data) - 4096)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("op", ["get", "put", "delete"])
def test_corruption_found_mid_operation_recovers(db: Path, op: str) -> None:
    with SQLiteStore(db) as store:
        for i in range(20):
            store.put(f"k{i}", entry_of(f"k{i}"))
    corrupt_pages_after_the_first(db)
    store = SQLiteStore(db)
    assert store.moved_aside == []  # the header is fine: found on first use
    if op == "get":
        assert store.get("k3") is None  # a miss, not an exception
    elif op == "put":
        store.put("new", entry_of("new"))  # the user's compile is kept
    else:
        assert store.delete("k3") is False
    assert store.moved_aside == [f"{db}.corrupt-1"]
    assert store.counters.corrupt == 1
    assert store.counters.errors == 0
    store.put("after", entry_of("after"))
    store.close()
    with SQLiteStore(db) as reopened:
        assert reopened.get("after") == entry_of("after")
        assert (reopened.get("new") is not None) == (op == "put")
        assert reopened.moved_aside == []


def test_read_only_store_reports_corruption_without_moving_the_file(db: Path) -> None:
    with SQLiteStore(db) as store:
        for i in range(20):
            store.put(f"k{i}", entry_of(f"k{i}"))
    corrupt_pages_after_the_first(db)
    reader = SQLiteStore(db, read_only=True)
    with pytest.raises(StoreError, match="malformed"):
        reader.get("k3")
    assert reader.moved_aside == []
    assert reader.counters.errors == 1
    assert not [name for name in files_next_to(db) if ".corrupt-" in name]
    reader.close()


def test_locked_database_is_a_store_error_not_a_reset(
    db: Path, raw: list[sqlite3.Connection]
) -> None:
    store = SQLiteStore(db, timeout=0.05)
    store.put("k", entry_of("k"))
    holder = connect(raw, db)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(StoreError, match="locked"):
        store.put("other", entry_of("other"))
    with pytest.raises(StoreError, match="locked"):
        store.delete("k")
    assert store.counters.errors == 2
    assert store.get("k") == entry_of("k")  # WAL readers are not blocked
    cache = Cache([store])
    cache.put("other", entry_of("other"))  # a miss and a counter, never an exception
    assert cache.stats()["sqlite"]["errors"] == 3
    holder.execute("COMMIT")
    store.put("other", entry_of("other"))
    assert store.get("other") == entry_of("other")
    assert store.moved_aside == []
    assert store.counters.corrupt == 0
    assert not [name for name in files_next_to(db) if ".corrupt-" in name]
    store.close()


def test_database_locked_while_opening_is_a_store_error_not_a_reset(
    db: Path, raw: list[sqlite3.Connection]
) -> None:
    with SQLiteStore(db) as store:
        store.put("k", entry_of("k"))
    holder = connect(raw, db)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")  # no other connection may even read
    with pytest.raises(StoreError, match="locked"):
        SQLiteStore(db, timeout=0.05)
    holder.execute("COMMIT")
    holder.close()
    with SQLiteStore(db) as reopened:
        assert reopened.get("k") == entry_of("k")
        assert reopened.moved_aside == []


def test_cap_held_and_running_totals_match_the_table(
    db: Path, raw: list[sqlite3.Connection]
) -> None:
    store = SQLiteStore(db, max_bytes=40_000)
    for i in range(120):
        store.put(f"k{i}", entry_of(str(i), 500 + (i * 977) % 4500))
        count, size = store.usage()
        assert size <= 40_000
    conn = connect(raw, db)
    table_count, table_bytes, data_bytes = conn.execute(
        "SELECT count(*), sum(size), sum(length(data)) FROM entries"
    ).fetchone()
    assert store.usage() == (table_count, table_bytes) == (count, data_bytes)
    assert store.counters.evictions == 120 - count
    store.close()


def last_access(raw: list[sqlite3.Connection], db: Path, key: str) -> float:
    row = connect(raw, db).execute("SELECT last_access FROM entries WHERE key = ?", (key,))
    return float(row.fetchone()[0])


def test_hits_refresh_the_lru_clock_at_most_once_a_minute(
    db: Path, raw: list[sqlite3.Connection]
) -> None:
    store = SQLiteStore(db)
    store.put("k", entry_of("k"))
    written = last_access(raw, db, "k")
    assert store.get("k") is not None
    assert last_access(raw, db, "k") == written  # a fresh entry's hit writes nothing
    an_hour_ago = time.time() - 3600
    connect(raw, db).execute("UPDATE entries SET last_access = ?", (an_hour_ago,))
    SQLiteStore(db, read_only=True).get("k")
    assert last_access(raw, db, "k") == an_hour_ago  # read-only never writes
    assert store.get("k") is not None
    assert last_access(raw, db, "k") > time.time() - 60
    assert sqlite_module.TOUCH_INTERVAL == 60.0
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-key"])
def test_corrupt_row_is_a_counted_miss_and_removed(
    db: Path, raw: list[sqlite3.Connection], damage: str
) -> None:
    store = SQLiteStore(db)
    store.put("k", entry_of("k"))
    store.put("other", entry_of("other"))
    conn = connect(raw, db)
    blob = conn.execute("SELECT data FROM entries WHERE key = 'k'").fetchone()[0]
    if damage == "flip":
        blob = blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:]
    elif damage == "truncate":
        blob = blob[:100]
    else:
        blob = conn.execute("SELECT data FROM entries WHERE key = 'other'").fetchone()[0]
    conn.execute("UPDATE entries SET data = ? WHERE key = 'k'", (blob,))
    assert store.get("k") is None
    assert (store.counters.corrupt, store.counters.misses) == (1, 1)
    assert conn.execute("SELECT count(*) FROM entries WHERE key = 'k'").fetchone() == (0,)
    assert store.usage()[0] == 1
    assert store.get("other") == entry_of("other")
    store.close()


def test_read_only_store(db: Path) -> None:
    reader = SQLiteStore(db, read_only=True)
    assert reader.get("k") is None  # no file yet: misses, and nothing created
    assert list(reader.keys()) == []
    assert reader.usage() == (0, 0)
    assert not db.parent.exists()
    with pytest.raises(ReadOnlyStoreError):
        reader.put("k", entry_of("k"))
    with SQLiteStore(db) as writer:
        writer.put("k", entry_of("k"))
    assert reader.get("k") == entry_of("k")  # the file appeared: now it is read
    reader.close()


def test_read_only_store_never_moves_a_foreign_file(db: Path) -> None:
    make_foreign_database(db, 0, 0)
    reader = SQLiteStore(db, read_only=True)
    with pytest.raises(StoreError, match="not a kernelcache database"):
        reader.get("k")
    assert Cache([reader]).get("k") is None
    assert reader.counters.errors == 2
    assert files_next_to(db) == [db.name]
    reader.close()


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_file_replaced_under_an_open_store(db: Path, how: str) -> None:
    """Another process moved the file aside (or a user deleted it): writes must go
    to the file now at the path, not to the old inode no one else will read."""
    store = SQLiteStore(db)
    store.put("before", entry_of("before"))
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{db}{suffix}")
        if how == "deleted":
            source.unlink()
        else:
            source.rename(f"{db}.elsewhere{suffix}")
    store.put("after", entry_of("after"))
    assert store.get("before") is None
    with SQLiteStore(db) as other:
        assert other.get("after") == entry_of("after")
    store.close()


def test_two_stores_on_one_file_see_each_other(db: Path) -> None:
    first, second = SQLiteStore(db, max_entries=10), SQLiteStore(db, max_entries=10)
    for i in range(30):
        (first if i % 2 else second).put(f"k{i}", entry_of(str(i)))
    assert first.usage() == second.usage()
    assert first.usage()[0] == 10
    assert sorted(first.keys()) == sorted(f"k{i}" for i in range(20, 30))
    assert second.get("k29") == entry_of("29")
    first.close()
    second.close()


def test_closed_store_raises_store_error(db: Path) -> None:
    store = SQLiteStore(db)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("k")


def test_forked_child_uses_its_own_connection(db: Path) -> None:
    """A child must not use (or close) the connection it inherited: SQLite forbids it."""
    store = SQLiteStore(db)
    store.put("parent", entry_of("parent"))
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:
            if store.get("parent") == entry_of("parent"):
                store.put("child", entry_of("child"))
                store.close()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("child") == entry_of("child")  # the parent's connection still works
    store.put("after", entry_of("after"))
    store.close()
