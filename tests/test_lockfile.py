"""FileFlightLock: mutual exclusion, timeouts, the unlink race, cleanup."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kernelcache import DiskStore
from kernelcache.errors import StoreError
from kernelcache.stores.lockfile import FileFlightLock, sweep_locks


def test_acquire_release_removes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "a" / "k.lock"  # folders made on demand
    lock = FileFlightLock(str(path))
    assert lock.acquire(1.0)
    assert path.exists()
    lock.release()
    assert not path.exists()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()


def test_second_holder_times_out_then_gets_it(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    first, second = FileFlightLock(path), FileFlightLock(path)
    assert first.acquire(0)
    start = time.monotonic()
    assert not second.acquire(0.1)
    # A wait that ignored its timeout would never end (the first keeps the lock): the
    # bound from above is loose, for a loaded machine that stalls this process.
    assert 0.1 <= time.monotonic() - start < 30.0
    assert not second.acquire(0)
    first.release()
    assert second.acquire(0)
    second.release()


def test_abandoned_wait_does_not_keep_the_lock(tmp_path: Path) -> None:
    # A waiter that gave up leaves a thread blocked in flock; when it gets the
    # lock it must let go at once, or the next waiter would hang.
    path = str(tmp_path / "k.lock")
    holder, quitter, next_one = (FileFlightLock(path) for _ in range(3))
    assert holder.acquire(0)
    assert not quitter.acquire(0.05)
    holder.release()
    assert next_one.acquire(2.0)
    next_one.release()


def test_waiter_blocked_on_an_unlinked_file_retries(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    holder = FileFlightLock(path)
    assert holder.acquire(0)
    got: list[bool] = []
    waiter = FileFlightLock(path)
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(5.0)))
    thread.start()
    time.sleep(0.1)
    holder.release()  # unlinks the file the waiter is blocked on
    thread.join(5)
    assert got == [True]
    # The waiter holds the file the path names now, so a newcomer is excluded.
    assert os.path.exists(path)
    assert not FileFlightLock(path).acquire(0.05)
    waiter.release()


def test_mutual_exclusion_under_contention(tmp_path: Path) -> None:
    path = str(tmp_path / "k.lock")
    inside, overlaps, rounds = [0], [0], 30

    def worker() -> None:
        for _ in range(rounds):
            lock = FileFlightLock(path)
            assert lock.acquire(10.0)
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            time.sleep(0.0005)
            inside[0] -= 1
            lock.release()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlaps == [0]
    assert not os.path.exists(path)


def test_os_errors_become_store_errors_and_are_counted(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    errors = []
    lock = FileFlightLock(str(blocker / "k.lock"), on_error=lambda: errors.append(1))
    with pytest.raises(StoreError, match="lock"):
        lock.acquire(0)
    assert errors == [1]


def test_sweep_removes_only_stale_unheld_locks(tmp_path: Path) -> None:
    stale, held = tmp_path / "a" / "stale.lock", tmp_path / "b" / "held.lock"
    for path in (stale, held):
        path.parent.mkdir()
        path.touch()
        os.utime(path, (1, 1))
    lock = FileFlightLock(str(held))
    assert lock.acquire(0)
    assert sweep_locks(str(tmp_path)) == 1
    assert not stale.exists()
    assert held.exists()
    lock.release()


def test_disk_store_lock_per_key_and_none_when_read_only(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    a, b = store.flight_lock("a"), store.flight_lock("b")
    assert a is not None
    assert b is not None
    assert a.acquire(0)
    assert b.acquire(0)  # different keys do not exclude each other
    a.release()
    b.release()
    assert DiskStore(tmp_path, read_only=True).flight_lock("a") is None
    with pytest.raises(ValueError, match="invalid cache key"):
        store.flight_lock("../x")


def test_forked_child_does_not_keep_a_released_lock(tmp_path: Path) -> None:
    # A child forked while the lock is held and awaited inherits both
    # descriptors; unless it closes them, the flock outlives the parent's
    # release and the waiter hangs until the child exits.
    path = str(tmp_path / "k.lock")
    holder, waiter = FileFlightLock(path), FileFlightLock(path)
    assert holder.acquire(0)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(5.0)))
    thread.start()
    time.sleep(0.1)
    pid = os.fork()
    if pid == 0:
        time.sleep(10)
        os._exit(0)
    try:
        holder.release()
        thread.join(10)
        # Had the child kept the lock, the waiter would have given up after its 5 s (the
        # child lives 10 s): no bound on how soon, which a loaded machine may stretch.
        assert got == [True]
        waiter.release()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
