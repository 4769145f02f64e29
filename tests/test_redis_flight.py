"""Cross-machine single-flight through the Redis lease, with real processes.

``compile_through_lease`` is the minimal harness of what ``Cache.get_or_compile``
does with a remote tier's lock: look up, take the lease, look up again (the
holder we waited for may have published), compile and put, release.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kernelcache import Cache, Entry
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.redis import RedisStore
from kernelcache.stores.redis_lease import RedisLease
from redis_server import RedisServer, unique_namespace

SPAWN = multiprocessing.get_context("spawn")


def compile_through_lease(
    cache: Cache, remote: RedisStore, key: str, seconds: float
) -> tuple[bool, Entry]:
    entry = cache.get(key)
    if entry is not None:
        return False, entry
    lock = remote.flight_lock(key)
    assert lock is not None
    held = lock.acquire(timeout=30)
    try:
        entry = cache.get(key)
        if entry is not None:
            return False, entry
        time.sleep(seconds)  # the compile
        entry = Entry({"kernel.cubin": os.urandom(4096)}, meta={"pid": os.getpid()})
        cache.put(key, entry)  # published before the lease is released
        return True, entry
    finally:
        if held:
            lock.release()


def _worker(url: str, ns: str, disk: str, key: str, barrier: Any, results: Any) -> None:
    remote = RedisStore(url, namespace=ns, lease=1.0)
    cache = Cache([MemoryStore(), DiskStore(disk), remote])
    barrier.wait(timeout=60)
    compiled, entry = compile_through_lease(cache, remote, key, seconds=0.5)
    results.put((os.getpid(), compiled, entry["kernel.cubin"]))


def _hold_forever(url: str, ns: str, key: str, ready: Any) -> None:
    lock = RedisStore(url, namespace=ns, lease=0.5).flight_lock(key)
    assert lock is not None and lock.acquire(timeout=5)
    ready.set()
    time.sleep(600)


@pytest.mark.slow
def test_eight_processes_on_two_machines_compile_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    ns = unique_namespace()
    barrier = SPAWN.Barrier(8)
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_worker,
            args=(redis_server.url, ns, str(tmp_path / f"machine{i % 2}"), "k", barrier, results),
        )
        for i in range(8)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    assert [proc.exitcode for proc in procs] == [0] * 8
    assert sum(compiled for _, compiled, _ in outcomes) == 1
    assert len({cubin for _, _, cubin in outcomes}) == 1  # everyone got the one compile


def test_lease_excludes_others_until_released(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=5.0)
    first, second = store.flight_lock("k"), store.flight_lock("k")
    assert first is not None and second is not None
    assert first.acquire(timeout=0)
    start = time.perf_counter()
    assert not second.acquire(timeout=0.3)
    assert 0.3 <= time.perf_counter() - start < 1.0
    first.release()
    assert second.acquire(timeout=0)
    other = store.flight_lock("other")  # leases are per key
    assert other is not None and other.acquire(timeout=0)
    other.release()
    second.release()


def test_lease_is_renewed_while_held(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=0.3)
    holder, waiter = store.flight_lock("k"), store.flight_lock("k")
    assert holder is not None and waiter is not None
    assert holder.acquire(timeout=0)
    assert not waiter.acquire(timeout=1.2)  # four lease lengths: only renewal keeps it
    holder.release()
    assert waiter.acquire(timeout=0)
    waiter.release()


def test_lease_of_a_killed_holder_expires_and_a_waiter_takes_over(
    redis_server: RedisServer,
) -> None:
    ns = unique_namespace()
    ready = SPAWN.Event()
    holder = SPAWN.Process(target=_hold_forever, args=(redis_server.url, ns, "k", ready))
    holder.start()
    try:
        assert ready.wait(timeout=30)
        waiter = RedisStore(redis_server.url, namespace=ns).flight_lock("k")
        assert waiter is not None
        assert not waiter.acquire(timeout=0.8)  # the live holder renews its 0.5 s lease
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        start = time.perf_counter()
        assert waiter.acquire(timeout=5)
        assert time.perf_counter() - start < 1.5
        waiter.release()
    finally:
        holder.kill()
        holder.join()


def test_only_the_owner_releases_a_lease(redis_server: RedisServer) -> None:
    ns = unique_namespace()
    store = RedisStore(redis_server.url, namespace=ns, lease=0.3)
    client = redis.Redis.from_url(redis_server.url)
    stalled = store.flight_lock("k")
    assert isinstance(stalled, RedisLease) and stalled.acquire(timeout=0)
    client.delete(f"kc:{ns}:lock:k")  # as if the holder stalled past its lease
    taker = store.flight_lock("k")
    assert isinstance(taker, RedisLease) and taker.acquire(timeout=0)
    time.sleep(0.3)  # the stalled holder's renewer notices it lost the lease
    assert stalled.lost
    stalled.release()  # must not delete the taker's lease
    assert client.get(f"kc:{ns}:lock:k") == (taker.token or "").encode()
    taker.release()
    assert client.exists(f"kc:{ns}:lock:k") == 0
