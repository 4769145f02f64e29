"""Cross-machine single-flight through the Redis lease, with real processes.

The eight-process test goes through ``Cache.get_or_compile`` itself: each
process has its own memory tier, one of two disk directories ("machines") and
the shared Redis, so only the lease can keep the two machines from compiling twice.
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
from kernelcache.stores.redis.lease import RedisLease
from redis_server import RedisServer, unique_namespace

SPAWN = multiprocessing.get_context("spawn")


def _worker(
    url: str, ns: str, disk: str, key: str, counter: str, barrier: Any, results: Any
) -> None:
    remote = RedisStore(url, namespace=ns, lease=1.0)
    cache = Cache([MemoryStore(), DiskStore(disk), remote])

    def compile_() -> Entry:
        with open(counter, "a") as f:  # one line per compile, whoever runs it
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        return Entry({"kernel.cubin": os.urandom(4096)}, meta={"pid": os.getpid()})

    barrier.wait(timeout=60)
    entry = cache.get_or_compile(key, compile_, timeout=30)
    results.put((os.getpid(), entry["kernel.cubin"]))


def _hold_forever(url: str, ns: str, key: str, ready: Any) -> None:
    lock = RedisStore(url, namespace=ns, lease=0.5).flight_lock(key)
    assert lock is not None
    assert lock.acquire(timeout=5)
    ready.set()
    time.sleep(600)


@pytest.mark.slow
def test_eight_processes_on_two_machines_compile_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    ns = unique_namespace()
    counter = tmp_path / "compiles.log"
    barrier = SPAWN.Barrier(8)
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_worker,
            args=(
                redis_server.url,
                ns,
                str(tmp_path / f"machine{i % 2}"),
                "k",
                str(counter),
                barrier,
                results,
            ),
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
    assert len(counter.read_text().splitlines()) == 1
    assert len({cubin for _, cubin in outcomes}) == 1  # everyone got the one compile


def test_lease_excludes_others_until_released(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=5.0)
    first, second = store.flight_lock("k"), store.flight_lock("k")
    assert first is not None
    assert second is not None
    assert first.acquire(timeout=0)
    start = time.perf_counter()
    assert not second.acquire(timeout=0.3)
    assert time.perf_counter() - start >= 0.3  # it waited its whole timeout
    first.release()
    assert second.acquire(timeout=0)
    other = store.flight_lock("other")  # leases are per key
    assert other is not None
    assert other.acquire(timeout=0)
    other.release()
    second.release()


def test_lease_is_renewed_while_held(redis_server: RedisServer) -> None:
    # A 1 s lease renewed by a thread: a loaded machine must starve that thread for
    # most of a second before the test could fail (issue 20.10).
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=1.0)
    holder, waiter = store.flight_lock("k"), store.flight_lock("k")
    assert holder is not None
    assert waiter is not None
    assert holder.acquire(timeout=0)
    assert not waiter.acquire(timeout=3.0)  # three lease lengths: only renewal keeps it
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
        assert waiter.acquire(timeout=60)  # the dead holder's lease expired
        waiter.release()
    finally:
        holder.kill()
        holder.join()


def test_only_the_owner_releases_a_lease(redis_server: RedisServer) -> None:
    ns = unique_namespace()
    store = RedisStore(redis_server.url, namespace=ns, lease=0.3)
    client = redis.Redis.from_url(redis_server.url)
    stalled = store.flight_lock("k")
    assert isinstance(stalled, RedisLease)
    assert stalled.acquire(timeout=0)
    client.delete(f"kc:{ns}:lock:{{k}}")  # as if the holder stalled past its lease
    taker = store.flight_lock("k")
    assert isinstance(taker, RedisLease)
    assert taker.acquire(timeout=0)
    time.sleep(0.3)  # the stalled holder's renewer notices it lost the lease
    assert stalled.lost
    stalled.release()  # must not delete the taker's lease
    assert client.get(f"kc:{ns}:lock:{{k}}") == (taker.token or "").encode()
    taker.release()
    assert client.exists(f"kc:{ns}:lock:{{k}}") == 0
