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
from redis_server import LOADED, RedisServer, unique_namespace

SPAWN = multiprocessing.get_context("spawn")
#: The lease of a holder that must renew it in time (a thread every third of it): a
#: loaded machine must starve that thread for most of a second to fail a test (issue 20.10).
HELD = 1.0


def _worker(
    url: str, ns: str, disk: str, key: str, counter: str, barrier: Any, results: Any
) -> None:
    # Eight processes starting on a loaded 2-core machine: a call that timed out would
    # let its waiter compile without the lease (nobody can coordinate through Redis),
    # and a lease lapsing while its renewer is starved would let a second one in. This
    # test is about the lease excluding, so neither may happen here: a generous
    # timeout, and a lease that outlasts the compile without renewal.
    remote = RedisStore(url, namespace=ns, lease=60.0, timeout=LOADED)
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
    lock = RedisStore(url, namespace=ns, lease=HELD, timeout=LOADED).flight_lock(key)
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
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=5.0, timeout=LOADED)
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
    store = RedisStore(redis_server.url, namespace=unique_namespace(), lease=HELD, timeout=LOADED)
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
        waiter = RedisStore(redis_server.url, namespace=ns, timeout=LOADED).flight_lock("k")
        assert waiter is not None
        assert not waiter.acquire(timeout=1.5 * HELD)  # the live holder renews its lease
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        assert waiter.acquire(timeout=60)  # the dead holder's lease expired
        waiter.release()
    finally:
        holder.kill()
        holder.join()


def test_only_the_owner_releases_a_lease(redis_server: RedisServer) -> None:
    ns = unique_namespace()
    name = f"kc:{ns}:lock:{{k}}"
    client = redis.Redis.from_url(redis_server.url)
    stalled = RedisStore(redis_server.url, namespace=ns, lease=0.3, timeout=LOADED).flight_lock("k")
    assert isinstance(stalled, RedisLease)
    assert stalled.acquire(timeout=0)
    client.delete(name)  # as if the holder stalled past its lease
    # The taker's lease outlasts the test: what Redis holds at the end must not depend
    # on its renewer getting CPU in time (a 0.3 s lease lapsed on a loaded machine).
    taker = RedisStore(redis_server.url, namespace=ns, lease=60, timeout=LOADED).flight_lock("k")
    assert isinstance(taker, RedisLease)
    assert taker.acquire(timeout=0)
    deadline = time.monotonic() + 30
    while not stalled.lost:  # the stalled holder's renewer (every 0.1 s) notices it lost it
        assert time.monotonic() < deadline, "the renewer never noticed its lease was gone"
        time.sleep(0.01)
    stalled.release()  # must not delete the taker's lease
    assert client.get(name) == (taker.token or "").encode()
    taker.release()
    assert client.exists(name) == 0
