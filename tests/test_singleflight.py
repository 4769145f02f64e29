"""Single-flight get_or_compile: threads, spawned processes, a SIGKILLed holder, failures."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings
from kernelcache.singleflight import Claim, Flight, carried
from kernelcache.stats.totals import read_totals
from kernelcache.stores.base import FlightLock, Store

WORKER = str(Path(__file__).with_name("sf_worker.py"))
SRC = str(Path(__file__).resolve().parents[1] / "src")


def make_cache(path: Path) -> Cache:
    return Cache([MemoryStore(), DiskStore(path)], settings=Settings.load(dir=str(path)))


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    c = make_cache(tmp_path / "cache")
    yield c
    c.close()


def run_threads(n: int, target: Callable[[], Any]) -> list[Any]:
    """Run ``target`` in ``n`` threads released together; results or exceptions, in order."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target()
        except Exception as exc:  # collected for the assertions, not swallowed
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


# Threads --------------------------------------------------------------------
def test_four_threads_compile_once(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    parked: list[int] = []
    real_wait = Flight.wait

    def wait(flight: Flight) -> bool:
        parked.append(1)  # a waiter on the leader's flight
        return real_wait(flight)

    monkeypatch.setattr(Flight, "wait", wait)

    def fn() -> bytes:
        calls.append(1)
        time.sleep(0.3)
        # The three others wait on this flight before it lands: a thread that a loaded
        # machine ran only after it landed would find the entry (a hit, no flight wait).
        deadline = time.monotonic() + 30
        while len(parked) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        return os.urandom(64)

    results = run_threads(4, lambda: cache.get_or_compile("k", fn))
    assert len(calls) == 1
    assert all(isinstance(r, Entry) for r in results)
    assert len({r["data"] for r in results}) == 1
    assert results[0].meta["compile_seconds"] >= 0.3
    assert cache.compile_stats()["flight_waits"] == 3


def test_exception_reaches_its_caller_and_waiters_retry(cache: Cache) -> None:
    calls = []

    def fn() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        if len(calls) == 1:
            raise ValueError("first compile fails")
        return b"ok"

    results = run_threads(4, lambda: cache.get_or_compile("k", fn))
    errors = [r for r in results if isinstance(r, ValueError)]
    assert len(errors) == 1
    assert str(errors[0]) == "first compile fails"
    assert [r["data"] for r in results if isinstance(r, Entry)] == [b"ok"] * 3
    assert len(calls) == 2  # the failed compile, then one retry for all waiters


def test_failures_are_not_cached(cache: Cache, tmp_path: Path) -> None:
    calls = []

    def fn() -> bytes:
        calls.append(1)
        time.sleep(0.05)
        raise OSError("compiler crashed")

    results = run_threads(4, lambda: cache.get_or_compile("k", fn))
    assert all(isinstance(r, OSError) for r in results)
    assert len(calls) == 4  # each caller ran it once, one at a time
    assert cache.get("k") is None
    assert list(DiskStore(tmp_path / "cache").keys()) == []
    assert cache.compile_stats()["compile_errors"] == 4


def test_bytes_are_wrapped_and_bad_results_rejected(cache: Cache) -> None:
    # Any bytes-like result is taken, beyond the declared bytes (as_entry).
    entry = cache.get_or_compile("k", lambda: bytearray(b"abc"))  # type: ignore[arg-type,return-value]
    assert entry.names == ["data"]
    assert entry["data"] == b"abc"
    with pytest.raises(TypeError, match="must return an Entry or bytes"):
        cache.get_or_compile("k2", lambda: "text")  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="timeout"):
        cache.get_or_compile("k3", lambda: b"", timeout=-1)
    with pytest.raises(ValueError, match="invalid cache key"):
        cache.get_or_compile("../k", lambda: b"")


def test_entry_meta_is_kept_and_compile_time_added(cache: Cache) -> None:
    entry = cache.get_or_compile("k", lambda: Entry({"a.cubin": b"x"}, meta={"name": "add"}))
    assert entry.meta["name"] == "add"
    assert entry.meta["compile_seconds"] >= 0
    again = make_cache(Path(cache.tiers[1].path)).get("k")  # type: ignore[attr-defined]
    assert again is not None
    assert again.meta == entry.meta


class _StuckLock:
    """A lock held forever by someone else: acquire always times out."""

    def acquire(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.05))
        return False

    def release(self) -> None:
        raise AssertionError("never acquired")


class _StuckTier(MemoryStore):
    def flight_lock(self, key: str) -> FlightLock | None:
        return _StuckLock()


def test_a_compile_asking_for_its_own_key_fails_at_once(cache: Cache) -> None:
    def fn() -> bytes:
        return cache.get_or_compile("k", lambda: b"inner")["data"]

    with pytest.raises(RuntimeError, match="from inside its own compile"):
        cache.get_or_compile("k", fn, timeout=float("inf"))
    assert cache.get("k") is None  # nothing cached, and the flight was released:
    assert cache.get_or_compile("k", lambda: b"ok", timeout=1)["data"] == b"ok"


def test_infinite_timeout_waits_for_the_compile(cache: Cache) -> None:
    calls = []

    def fn() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        return b"x"

    results = run_threads(3, lambda: cache.get_or_compile("k", fn, timeout=float("inf")))
    assert [r["data"] for r in results] == [b"x"] * 3
    assert len(calls) == 1


def test_claim_publish_and_abandon(cache: Cache) -> None:
    claim = cache.claim("k")
    assert claim.entry is None
    assert claim.leads
    other: list[Any] = []
    waiter = threading.Thread(target=lambda: other.append(cache.claim("k", timeout=30)))
    waiter.start()
    time.sleep(0.1)  # the waiter is parked on the flight, not compiling
    assert not other
    stored = claim.publish(b"compiled", seconds=1.5)
    waiter.join(10)
    assert not claim.leads
    assert other[0].entry["data"] == b"compiled"
    # The waiter got the entry as stored: its files lie inside the disk tier.
    assert Path(other[0].entry.path("data")).is_relative_to(cache.tiers[1].path)
    assert stored.key == "k"
    assert stored.meta["compile_seconds"] == 1.5
    assert cache.compile_stats()["compile_seconds"] == 1.5
    with pytest.raises(RuntimeError, match="nothing to publish"):
        claim.publish(b"again")
    # Abandoning (here: leaving the with block) lets the next caller lead at once.
    with cache.claim("k2") as first:
        assert first.leads
    assert cache.claim("k2", timeout=0).leads


def test_put_returns_the_bound_entry_and_leaves_the_callers_alone(cache: Cache) -> None:
    mine = Entry({"kernel.cubin": b"\x7fELF"}, meta={"n": 1})
    stored = cache.put("k", mine)
    assert mine.key is None
    assert stored.key == "k"
    assert stored == mine
    disk = cache.tiers[1]
    assert isinstance(disk, DiskStore)
    path = Path(stored.path("kernel.cubin"))
    assert path.read_bytes() == b"\x7fELF"
    assert path.is_relative_to(disk.path)
    assert not Path(mine.path("kernel.cubin")).is_relative_to(disk.path)


def test_lock_timeout_compiles_anyway(tmp_path: Path) -> None:
    tiers: list[Store] = [_StuckTier()]
    cache = Cache(tiers, settings=Settings.load(dir=str(tmp_path)))
    entry = cache.get_or_compile("k", lambda: b"x", timeout=0.05)
    assert entry["data"] == b"x"
    assert cache.compile_stats()["lock_timeouts"] == 1


def test_waiting_thread_times_out_and_compiles_itself(cache: Cache) -> None:
    release, compiling = threading.Event(), threading.Event()
    calls = []

    def slow() -> bytes:
        calls.append("slow")
        compiling.set()
        release.wait(10)
        return b"slow"

    leader = threading.Thread(target=lambda: cache.get_or_compile("k", slow, timeout=0.2))
    leader.start()
    assert compiling.wait(30)  # the leader holds the flight (not: a sleep it may outlast)
    start = time.monotonic()
    entry = cache.get_or_compile("k", lambda: b"fast", timeout=0.2)
    waited = time.monotonic() - start
    release.set()
    leader.join(10)
    assert entry["data"] == b"fast"
    assert calls == ["slow"]
    assert waited >= 0.1  # a full timeout for the leader's compile, then its own
    assert cache.compile_stats()["lock_timeouts"] == 1


# Processes ------------------------------------------------------------------
def spawn(opts: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, WORKER, json.dumps(opts)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def result(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.slow
def test_eight_processes_compile_once(tmp_path: Path) -> None:
    counter, go, asked = tmp_path / "count", tmp_path / "go", tmp_path / "asked"
    asked.mkdir()
    opts: dict[str, Any] = {"dir": str(tmp_path / "c"), "key": "k", "counter": str(counter)}
    # The compile waits until all eight asked (a process a loaded machine ran a second
    # late would find the entry: no overlap to test).
    opts.update(go=str(go), asked_dir=str(asked), quorum=8)
    procs = [spawn({**opts, "sleep": 1.0}) for _ in range(8)]
    go.touch()
    results = [result(p) for p in procs]
    assert len(counter.read_text().splitlines()) == 1
    assert len({r["digest"] for r in results}) == 1
    (compiler,) = [r for r in results if r["compiled"]]
    # Every process asked before the compile ended: they really did overlap.
    assert max(r["asked"] for r in results) < compiler["compile_end"]


@pytest.mark.slow
def test_claims_held_across_calls_compile_once_across_processes(tmp_path: Path) -> None:
    """get, claim, compile and publish as separate calls: still one compile for four processes."""
    counter, go, asked = tmp_path / "count", tmp_path / "go", tmp_path / "asked"
    asked.mkdir()
    opts: dict[str, Any] = {"dir": str(tmp_path / "c"), "key": "k", "counter": str(counter)}
    opts.update(go=str(go), asked_dir=str(asked), quorum=4)  # all ask before the compile ends
    procs = [spawn({**opts, "sleep": 0.5, "api": "claim"}) for _ in range(4)]
    go.touch()
    results = [result(p) for p in procs]
    assert len(counter.read_text().splitlines()) == 1
    assert len({r["digest"] for r in results}) == 1
    (compiler,) = [r for r in results if r["compiled"]]
    assert max(r["asked"] for r in results) < compiler["compile_end"]


@pytest.mark.slow
def test_killed_lock_holder_does_not_block_waiters(tmp_path: Path) -> None:
    counter, started = tmp_path / "count", tmp_path / "started"
    opts = {"dir": str(tmp_path / "c"), "key": "k", "counter": str(counter), "timeout": 30.0}
    holder = spawn({**opts, "mode": "hang", "started": str(started)})
    deadline = time.monotonic() + 20
    while not started.exists():
        assert time.monotonic() < deadline, "the holder never started compiling"
        time.sleep(0.01)
    waiters = [spawn({**opts, "sleep": 0.2}) for _ in range(2)]
    time.sleep(0.5)  # let both reach the lock
    killed = time.monotonic()
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=10)  # reaps it and closes its pipe
    results = [result(w) for w in waiters]
    assert len({r["digest"] for r in results}) == 1
    assert sum(r["compiled"] for r in results) == 1
    assert len(counter.read_text().splitlines()) == 2  # the killed compile and one more
    assert all(r["asked"] < killed for r in results)
    # Well inside the 30 s lock timeout (waiters kept out by the dead holder's lock would
    # return ~29.5 s after the kill): the kernel released its flock. Not a speed: a loaded
    # machine may take seconds to run the waiter, its compile and its put.
    assert max(r["returned"] for r in results) - killed < 20.0


@pytest.mark.slow
def test_failed_compile_in_one_process_is_retried_by_another(tmp_path: Path) -> None:
    counter, started = tmp_path / "count", tmp_path / "started"
    opts = {"dir": str(tmp_path / "c"), "key": "k", "counter": str(counter)}
    gate = tmp_path / "gate"
    failing = spawn({**opts, "mode": "fail", "started": str(started), "gate": str(gate)})
    while not started.exists():
        time.sleep(0.01)
    waiter = spawn({**opts, "sleep": 0.1})
    time.sleep(0.3)  # let the waiter reach the lock
    failed_at = time.monotonic()
    gate.touch()
    failed, ok = result(failing), result(waiter)
    assert failed["error"] == "compile failed on purpose"
    # It asked while the failing compile held the lock and got its entry only after
    # that compile failed: it waited, then retried.
    assert ok["compiled"]
    assert ok["asked"] < failed_at < ok["returned"]
    assert len(counter.read_text().splitlines()) == 2
    assert make_cache(tmp_path / "c").get("k") is not None


def test_forked_child_does_not_wait_for_the_parents_threads(cache: Cache) -> None:
    gate, compiling = threading.Event(), threading.Event()

    def slow() -> bytes:
        compiling.set()
        gate.wait(10)
        return b"parent"

    leader = threading.Thread(target=lambda: cache.get_or_compile("k", slow, timeout=3.0))
    leader.start()
    assert compiling.wait(30)  # forked while the parent's leader holds the key's locks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's flight must not hold it up
        code = 1
        try:
            start = time.monotonic()
            entry = cache.get_or_compile("k", lambda: b"child", timeout=60.0)
            os.write(write, json.dumps([entry["data"].decode(), time.monotonic() - start]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    time.sleep(0.2)
    gate.set()  # the parent's compile ends; the child was waiting on its disk lock
    leader.join(10)
    data, elapsed = json.loads(os.read(read, 1000))
    os.close(read)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert data == "parent"  # it waited for the parent's compile instead of timing out
    assert elapsed < 60.0


@pytest.mark.slow
def test_waiter_compiles_itself_when_a_live_holder_is_stuck(tmp_path: Path) -> None:
    counter, started = tmp_path / "count", tmp_path / "started"
    opts = {"dir": str(tmp_path / "c"), "key": "k", "counter": str(counter)}
    holder = spawn({**opts, "mode": "hang", "started": str(started)})
    try:
        while not started.exists():
            time.sleep(0.01)
        waiter = result(spawn({**opts, "timeout": 0.5}))
        assert waiter["compiled"]
        # Its 0.5 s timeout, then its own compile (the holder hangs for an hour; result()
        # gives up after 30 s): a bound loose enough for a loaded machine.
        assert 0.5 <= waiter["returned"] - waiter["asked"] < 20.0
        assert len(counter.read_text().splitlines()) == 2
    finally:
        holder.kill()
        holder.communicate(timeout=10)


def _cache_in(path: Path) -> Cache:
    return Cache([MemoryStore(), DiskStore(str(path))])


def _publish_nested(cache: Cache) -> Entry:
    """Compiles three deep: "inner" (1 s) inside "middle" (2.5 s) inside "outer" (4 s),
    as torch's C++ build inside its FX graph inside its AOTAutograd compile; the outer
    entry as stored."""
    with cache.claim("outer") as outer:
        with cache.claim("middle") as middle:
            with cache.claim("inner") as inner:
                inner.publish(b"i", seconds=1.0)
            middle.publish(b"m", seconds=2.5)
        return outer.publish(b"o", seconds=4.0)


def test_a_compile_inside_another_is_counted_once(tmp_path: Path) -> None:
    """torch's AOTAutograd compile holds its FX graph's, which holds its C++ builds':
    each entry keeps its whole time, the statistics count each second once."""
    cache = _cache_in(tmp_path)
    stored = _publish_nested(cache)
    with cache.claim("after") as after:  # not inside any: counted whole
        after.publish(b"a", seconds=0.5)
    middle_entry = cache.get("middle")
    assert stored.meta["compile_seconds"] == 4.0
    assert middle_entry is not None
    assert middle_entry.meta["compile_seconds"] == 2.5
    stats = cache.compile_stats()
    assert stats["compiles"] == 4
    assert stats["compile_seconds"] == 4.5


def test_a_hit_saves_a_nested_compile_once(tmp_path: Path) -> None:
    """torch loads an AOTAutograd hit's FX graphs, and those their C++ builds, as hits of
    their own: the outer hit saved their compile time already. An inner entry's hit
    without the outer's saves its own time."""
    cache = _cache_in(tmp_path)
    _publish_nested(cache)
    # A value that is not a list of keys is ignored.
    cache.put("odd", Entry({"a": b"x"}, meta={"compile_seconds": 0.5, "nested": "middle"}))

    def saved(*keys: str, cache: Cache | None = None) -> float:
        """Seconds saved by disk hits on ``keys``, in that order, in a new Cache."""
        fresh = cache or Cache([DiskStore(str(tmp_path))])
        for key in keys:
            assert fresh.get(key) is not None
        return float(fresh.stats()["disk"]["seconds_saved"])

    nested = {key: (cache.get(key) or Entry({})).meta.get("nested") for key in ("outer", "middle")}
    assert nested == {"outer": ["middle"], "middle": ["inner"]}
    assert saved("outer", "middle", "inner") == 4.0
    assert saved("middle", "inner") == 2.5
    assert saved("inner") == 1.0
    # Another Cache over the same directory (kernelcache.inductor's C++ builds use one
    # without the memory tier) counts into the same statistics: the credit holds there.
    view = Cache([DiskStore(str(tmp_path))])
    assert (saved("outer"), saved("middle", "inner", cache=view)) == (4.0, 0.0)
    assert saved("odd", "middle") == 3.0


def test_compiles_nest_only_within_their_own_statistics_and_thread(tmp_path: Path) -> None:
    a, b = _cache_in(tmp_path / "a"), _cache_in(tmp_path / "b")
    same_dir = _cache_in(tmp_path / "a")  # another Cache, the same totals as a's
    with a.claim("outer") as outer:
        with b.claim("elsewhere") as elsewhere:  # another directory: its own statistics
            elsewhere.publish(b"e", seconds=1.0)
        with same_dir.claim("beside") as beside:
            beside.publish(b"s", seconds=0.5)
        other: list[Claim] = []
        thread = threading.Thread(target=lambda: other.append(a.claim("threaded")))
        thread.start()
        thread.join()
        other[0].publish(b"t", seconds=0.25)  # led by another thread: not inside outer
        outer.publish(b"o", seconds=2.0)
    assert b.compile_stats()["compile_seconds"] == 1.0
    assert same_dir.compile_stats()["compile_seconds"] == 0.5
    assert a.compile_stats()["compile_seconds"] == 1.5 + 0.25
    for cache in (a, same_dir):
        cache.flush_stats()
    # Through the directory's totals: outer's 2 s, of which 0.5 s are beside's, plus 0.25 s.
    assert read_totals(str(tmp_path / "a"))["lifetime"]["compile"]["compile_seconds"] == 2.25


def test_an_abandoned_compile_inside_leaves_the_outer_whole(tmp_path: Path) -> None:
    cache = _cache_in(tmp_path)
    with cache.claim("outer") as outer:
        with cache.claim("inner"):
            pass  # left without a publish: abandoned, counted nowhere
        outer.publish(b"o", seconds=3.0)
    stats = cache.compile_stats()
    assert (stats["compiles"], stats["compile_seconds"]) == (1, 3.0)


def test_a_compile_carried_to_a_pool_thread_counts_inside_the_claim_that_waits(
    tmp_path: Path,
) -> None:
    """torch builds an FX graph's C++ kernels on its compile threads while the graph's
    compile waits: carried there, they count as if built inline, two at once too."""
    cache = _cache_in(tmp_path)
    both = threading.Barrier(2)

    def build(key: str, seconds: float, together: bool = False) -> None:
        if together:
            both.wait(timeout=10)  # the two builds run on both threads at once
        with cache.claim(key) as claim:
            claim.publish(key.encode(), seconds=seconds)

    pool = ThreadPoolExecutor(2)
    try:
        with cache.claim("graph") as graph:
            tasks = [carried(functools.partial(build, k, s, True)) for k, s in (("a", 1), ("b", 2))]
            for future in [pool.submit(task) for task in tasks]:
                future.result(timeout=10)
            stored = graph.publish(b"g", seconds=2.5)
        assert sorted(stored.meta["nested"]) == ["a", "b"]
        # The builds' 3 s, once; the graph's own time is none (its builds ran side by side).
        assert cache.compile_stats()["compile_seconds"] == 3.0
        # The pool's threads are as they were: a task not carried nests in nothing.
        with cache.claim("later") as later:
            pool.submit(build, "c", 0.25).result(timeout=10)
            assert "nested" not in later.publish(b"l", seconds=1.0).meta
    finally:
        pool.shutdown()
    # Run on the claim's own thread (a pool of one thread runs tasks inline): as inline.
    with cache.claim("inline") as inline:
        carried(functools.partial(build, "d", 0.5))()
        assert inline.publish(b"i", seconds=1.0).meta["nested"] == ["d"]
    assert cache.compile_stats()["compile_seconds"] == 3.0 + 1.25 + 1.0
    # A thread that leads no claim has nothing to carry (this one may hold claims that
    # earlier tests left open on purpose).
    task, got = functools.partial(build, "e", 0.5), []
    thread = threading.Thread(target=lambda: got.append(carried(task)))
    thread.start()
    thread.join()
    assert got == [task]


def test_a_claim_handed_over_to_another_thread_is_no_outer_claim_here(tmp_path: Path) -> None:
    """TileLang's caller compiles, hands its claim to a thread that publishes later, and
    compiles the next kernel: that one is not nested in the first (nor its seconds taken
    out of the first's), and the first counts its own time."""
    cache = _cache_in(tmp_path)
    first = cache.claim("first").hand_over()
    with cache.claim("second") as second:
        assert "nested" not in second.publish(b"s", seconds=1.0).meta
    publisher = threading.Thread(target=lambda: first.publish(b"f", seconds=2.0))
    publisher.start()
    publisher.join(10)
    stored = cache.get("first")
    assert stored is not None
    assert "nested" not in stored.meta
    assert stored.meta["compile_seconds"] == 2.0
    assert cache.compile_stats()["compile_seconds"] == 3.0
    # A compile that raised: counted, and the claim given up (the waiters go on).
    failed = cache.claim("failed")
    failed.fail()
    failed.fail()
    assert not failed.leads
    assert cache.compile_stats()["compile_errors"] == 1
