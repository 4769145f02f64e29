"""Issue 22: the disk tier fails soft under the errors network filesystems give.

Each fault is one injected error (a monkeypatched ``os`` call) on local disk:
ESTALE, EIO, EBUSY and ENOLCK must be a counted miss or one retry, must never
reach the caller, and must never leave a lock held, a key poisoned, an entry
half-published or staging folders behind for good.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kernelcache import Cache, Entry, StoreError
from kernelcache.stores.disk import DiskStore, cleaner
from kernelcache.stores.lockfile import FileFlightLock


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's faults here are injected into entry files' reads and writes: small
    entries go into files, as before packing. Packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def entry_of(tag: str, size: int = 2000) -> Entry:
    return Entry({"kernel.cubin": tag.encode().ljust(size, b"#")}, meta={"t": tag})


def fail_once(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    code: int,
    when: Callable[..., bool],
    times: int = 1,
    module: Any = os,
) -> list[int]:
    """Make ``module.name`` raise ``OSError(code)`` for the next ``times`` calls that ``when``
    accepts; returns a list that grows by one per injected error."""
    real = getattr(module, name)
    injected: list[int] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        if len(injected) < times and when(*args, **kwargs):
            injected.append(code)
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)
    return injected


def lockable(path: str) -> bool:
    """Whether another open file description can flock ``path`` right now."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO])
def test_error_after_the_tier_lock_is_taken_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    store = DiskStore(tmp_path)
    store.put("warm", entry_of("w"))  # the counter file exists and its fd is open
    space = store.layout.space
    injected = fail_once(monkeypatch, "lstat", code, lambda p, *a, **k: p == space)
    with pytest.raises(StoreError):
        store.put("k", entry_of("k"))
    assert injected == [code]
    assert lockable(space), "the tier lock leaked: every other process's puts would block"
    store.put("k", entry_of("k"))
    assert store.get("k") is not None
    assert store.counters.errors == 1
    assert store.usage() == store.recount()


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO])
def test_error_after_a_flight_lock_is_taken_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = str(tmp_path / "k.lock")
    errors: list[int] = []
    lock = FileFlightLock(path, on_error=lambda: errors.append(1))
    injected = fail_once(monkeypatch, "lstat", code, lambda p, *a, **k: p == path)
    with pytest.raises(StoreError):
        lock.acquire(1.0)
    assert injected == [code]
    assert errors == [1]
    other = FileFlightLock(path)
    assert other.acquire(0), "the locked descriptor leaked: waiters would sit out their timeout"
    other.release()


def test_unlink_error_in_release_is_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "k.lock")
    errors: list[int] = []
    lock = FileFlightLock(path, on_error=lambda: errors.append(1))
    assert lock.acquire(1.0)
    fail_once(monkeypatch, "unlink", errno.EBUSY, lambda p, *a, **k: p == path)
    lock.release()  # no exception: the file is left to sweep_locks
    assert errors == [1]
    assert FileFlightLock(path).acquire(0), "the lock itself was released all the same"


def busy_lock_unlinks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return fail_once(
        monkeypatch, "unlink", errno.EBUSY, lambda p, *a, **k: str(p).endswith(".lock"), times=99
    )


def test_failed_release_after_a_compile_reaches_no_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache([DiskStore(tmp_path)], persist_stats=False)
    injected = busy_lock_unlinks(monkeypatch)
    entry = cache.get_or_compile("k", lambda: b"compiled")
    assert entry["data"] == b"compiled"
    assert injected
    assert cache.get_or_compile("k", lambda: b"again")["data"] == b"compiled"


def test_failed_release_after_finding_the_entry_does_not_poison_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The entry appears between the caller's miss and its lock (another process
    # published it): the leader releases its lock as soon as it finds the entry.
    cache = Cache([DiskStore(tmp_path)], persist_stats=False)
    DiskStore(tmp_path).put("k", Entry({"data": b"theirs"}))
    injected = busy_lock_unlinks(monkeypatch)
    with cache.claim("k") as claim:
        assert claim.entry is not None
        assert claim.entry["data"] == b"theirs"
    assert injected
    # The key is not left in the in-process table ("requested again from inside its own compile").
    assert cache.get_or_compile("k", lambda: b"mine")["data"] == b"theirs"
    with cache.claim("k2") as claim:
        assert claim.leads
        claim.publish(b"two")


def test_estale_on_open_is_retried_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)
    store.put("k", entry_of("k"))
    injected = fail_once(
        monkeypatch, "open", errno.ESTALE, lambda p, *a, **k: str(p).startswith("k.")
    )
    got = store.get("k")
    assert injected == [errno.ESTALE]
    assert got is not None
    assert got.meta == {"t": "k"}
    assert (store.counters.hits, store.counters.misses, store.counters.errors) == (1, 0, 1)


def test_estale_twice_is_a_counted_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)
    store.put("k", entry_of("k"))
    fail_once(monkeypatch, "pread", errno.ESTALE, lambda fd, n, off: off == 0, times=2)
    assert store.get("k") is None
    assert (store.counters.misses, store.counters.errors) == (1, 2)
    assert store.get("k") is not None  # nothing was removed


def test_a_short_read_is_not_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)
    store.put("k", entry_of("k"))
    real = os.pread
    cut: list[int] = []

    def short(fd: int, n: int, offset: int) -> bytes:
        data = real(fd, n, offset)
        if not cut:
            cut.append(len(data))
            return data[: len(data) // 2]
        return data

    monkeypatch.setattr(os, "pread", short)
    got = store.get("k")
    assert cut
    assert got is not None
    assert got.meta == {"t": "k"}
    assert store.counters.corrupt == 0
    assert os.path.exists(store.layout.entry_path("k")), "a good entry was removed"


def test_flock_unsupported_puts_and_single_flight_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lustre mounted without -o flock: every flock fails with ENOLCK.
    injected = fail_once(monkeypatch, "flock", errno.ENOLCK, lambda *a: True, 10**6, fcntl)
    store = DiskStore(tmp_path, max_bytes=40_000)
    for i in range(30):
        store.put(f"k{i}", entry_of(f"k{i}"))
    cleaner.finish()  # with leases, eviction runs in a thread of its own (issue 40)
    assert injected
    assert store.counters.errors == 0
    assert store.get("k29") is not None
    assert store.usage() == store.recount()
    assert store.usage()[1] <= 40_000
    cache = Cache([store], persist_stats=False)
    assert cache.get_or_compile("new", lambda: b"x")["data"] == b"x"
    cleaner.finish()
    left = [name for _dir, _sub, names in os.walk(store.locks_dir) for name in names]
    assert left == [], "a lease file was left behind"


def test_busy_folders_left_in_staging_are_removed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path)
    for i in range(3):
        entry = store.put(f"k{i}", entry_of(f"k{i}"))
        entry.path("kernel.cubin")  # an extraction folder to remove with the entry
    real_rmtree = shutil.rmtree

    def busy_rmtree(path: str, ignore_errors: bool = False, **kw: Any) -> None:
        # What rmtree leaves when rmdir gives EBUSY (a file open on another NFS client).
        if not ignore_errors:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(shutil, "rmtree", busy_rmtree)
    for i in range(3):
        assert store.delete(f"k{i}")
    assert any(name.startswith("trash.") for name in os.listdir(store.layout.staging))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    store.put("later", entry_of("later"))  # the next change retries what was left
    assert os.listdir(store.layout.staging) == []


def test_trash_left_by_another_process_is_swept_at_open(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    left = Path(store.layout.trash())
    (left / "tag").mkdir(parents=True)
    (left / "tag" / "kernel.cubin").write_bytes(b"x")
    DiskStore(tmp_path)  # no age rule for trash: it was doomed when it was renamed there
    assert not left.exists()


def test_no_fault_reaches_the_caller_of_get_or_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache([DiskStore(tmp_path, max_bytes=30_000)], persist_stats=False)
    for code in (errno.ESTALE, errno.EIO, errno.EBUSY, errno.ENOLCK):
        for name in ("open", "lstat", "unlink", "rename", "replace", "pread", "link"):
            monkeypatch.undo()
            fail_once(monkeypatch, name, code, lambda *a, **k: True, times=3)
            key = f"{name}-{code}"
            data = key.encode()
            assert cache.get_or_compile(key, functools.partial(bytes, data))["data"] == data
    monkeypatch.undo()
    store = cache.tiers[0]
    assert isinstance(store, DiskStore)
    assert store.usage() == store.recount()
    assert all(store.check(info) is None for info in store.scan())
