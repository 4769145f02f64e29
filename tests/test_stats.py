"""Persistent statistics: batched merges, seconds saved, periods, processes adding up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kernelcache.stats.recorder as stats_mod
import kernelcache.stats.totals as totals_mod
from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings
from kernelcache.stats.totals import read_key_hits, read_totals, zero_period

SRC = str(Path(__file__).resolve().parents[1] / "src")
WORKER = str(Path(__file__).with_name("sf_worker.py"))


def make_cache(path: Path, **kw: Any) -> Cache:
    return Cache([MemoryStore(), DiskStore(path)], settings=Settings.load(dir=str(path)), **kw)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def cache(cache_dir: Path) -> Iterator[Cache]:
    c = make_cache(cache_dir)
    yield c
    c.close()


def tiers(cache_dir: Path, section: str = "lifetime") -> dict[str, dict[str, float]]:
    return dict(read_totals(str(cache_dir))[section]["tiers"])


def test_hits_are_not_written_until_a_flush(
    cache: Cache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    merges: list[Any] = []
    real = totals_mod.merge

    def counting_merge(*args: Any) -> None:
        merges.append(args)
        real(*args)

    monkeypatch.setattr(stats_mod, "merge", counting_merge)
    cache.put("k", Entry({"a": b"x"}, meta={"compile_seconds": 2.0}))
    for _ in range(1000):
        assert cache.get("k") is not None
    assert merges == []  # no write per hit
    cache.flush_stats()
    assert len(merges) == 1
    memory = tiers(cache_dir)["memory"]
    assert memory["hits"] == 1000
    assert memory["seconds_saved"] == pytest.approx(2000.0)
    hits, saved = read_key_hits(str(cache_dir))["k"]
    assert hits == 1000
    assert saved == pytest.approx(2000.0)


def test_a_flush_inside_a_flush_on_one_thread_is_counted_not_a_deadlock(
    cache: Cache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cache collected mid-merge flushes from its finalizer on the thread holding the
    stats lock; a second flock would wait for itself (pytest-timeout would catch a hang)."""
    other = make_cache(cache_dir)
    other.put("o", Entry({"a": b"y"}))
    real = totals_mod.merge
    nested: list[int] = []

    def merge_then_reenter(*args: Any) -> None:
        # Fault injection: the re-entry must happen while merge holds the stats lock,
        # and only the private writer runs at that moment.
        real_write = totals_mod._write_json  # noqa: SLF001

        def write(*a: Any) -> None:
            if not nested:
                nested.append(1)
                other.flush_stats()  # what a finalizer running here would do
            real_write(*a)

        monkeypatch.setattr(totals_mod, "_write_json", write)
        real(*args)

    monkeypatch.setattr(stats_mod, "merge", merge_then_reenter)
    cache.put("k", Entry({"a": b"x"}))
    cache.flush_stats()
    assert nested == [1]
    assert other.flush_errors == 1
    assert tiers(cache_dir)["memory"]["puts"] == 1  # the outer batch still landed


def test_flushes_add_only_what_is_new(cache: Cache, cache_dir: Path) -> None:
    cache.get_or_compile("k", lambda: b"x")
    cache.flush_stats()
    cache.flush_stats()  # nothing new: nothing added
    cache.get("k")
    cache.get("missing")
    cache.close()
    t = tiers(cache_dir)
    assert t["memory"]["hits"] == 1
    assert t["memory"]["misses"] == 2
    assert t["memory"]["puts"] == 1
    assert t["disk"]["misses"] == 2
    assert t["disk"]["puts"] == 1
    compile_counts = read_totals(str(cache_dir))["lifetime"]["compile"]
    assert compile_counts["compiles"] == 1
    assert compile_counts["compile_seconds"] >= 0


def test_disk_hits_save_seconds_and_are_promoted(cache_dir: Path) -> None:
    with make_cache(cache_dir) as first:
        first.put("k", Entry({"a": b"x"}, meta={"compile_seconds": 1.5}))
    with make_cache(cache_dir) as second:
        assert second.get("k") is not None  # from disk, promoted to memory
        assert second.get("k") is not None  # from memory
        local = second.stats()
    assert local["disk"]["seconds_saved"] == 1.5
    assert local["memory"]["seconds_saved"] == 1.5
    t = tiers(cache_dir)
    assert t["disk"]["hits"] == 1
    assert t["memory"]["hits"] == 1
    assert t["disk"]["seconds_saved"] + t["memory"]["seconds_saved"] == pytest.approx(3.0)


def test_disk_first_cache_counts_hits_exactly(cache_dir: Path) -> None:
    with Cache([DiskStore(cache_dir)], settings=Settings.load(dir=str(cache_dir))) as writer:
        writer.put("k", Entry({"a": b"x"}, meta={"compile_seconds": 0.25}))
    with Cache([DiskStore(cache_dir)], settings=Settings.load(dir=str(cache_dir))) as reader:
        for _ in range(4):
            assert reader.get("k") is not None
        assert reader.stats()["disk"]["seconds_saved"] == pytest.approx(1.0)
    hits, saved = read_key_hits(str(cache_dir))["k"]
    assert hits == 4
    assert saved == pytest.approx(1.0)


def test_single_flight_recheck_does_not_count_a_second_miss(cache: Cache, cache_dir: Path) -> None:
    cache.get_or_compile("k", lambda: b"x")
    cache.close()
    assert tiers(cache_dir)["disk"]["misses"] == 1


def test_hot_loop_beyond_the_sample_is_scaled(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats_mod, "HIT_SAMPLE", 8)
    with make_cache(cache_dir) as cache:
        cache.put("a", Entry({"a": b"x"}, meta={"compile_seconds": 1.0}))
        for _ in range(100):
            cache.get("a")
        assert cache.stats()["memory"]["seconds_saved"] == pytest.approx(100.0)


def test_zero_starts_a_new_period_and_keeps_lifetime(cache: Cache, cache_dir: Path) -> None:
    cache.get_or_compile("k", lambda: b"x")
    cache.flush_stats()
    assert zero_period(str(cache_dir))
    assert tiers(cache_dir, "period") == {}
    cache.get("k")
    cache.flush_stats()
    period = tiers(cache_dir, "period")
    assert set(period) == {"memory"}
    assert period["memory"]["hits"] == 1
    assert period["memory"].get("puts", 0) == 0
    assert tiers(cache_dir)["memory"]["hits"] == 1
    assert tiers(cache_dir)["memory"]["puts"] == 1
    assert not zero_period(str(cache_dir.parent / "nothing-here"))


def test_damaged_totals_are_moved_aside(cache: Cache, cache_dir: Path) -> None:
    cache.get_or_compile("k", lambda: b"x")
    cache.flush_stats()
    totals = cache_dir / "v1" / "stats" / "totals.json"
    totals.write_text('{"version": 1, "lifetime": 3}')
    assert read_totals(str(cache_dir)).get("damaged") is True
    cache.get("k")
    cache.flush_stats()
    assert (cache_dir / "v1" / "stats" / "totals.json.corrupt").exists()
    memory = tiers(cache_dir)["memory"]
    assert memory["hits"] == 1
    assert memory.get("puts", 0) == 0  # counting started over


def test_a_removed_directory_is_not_recreated(cache: Cache, cache_dir: Path) -> None:
    import shutil

    cache.get_or_compile("k", lambda: b"x")
    shutil.rmtree(cache_dir)
    cache.flush_stats()  # must not raise, must not resurrect the directory
    assert not cache_dir.exists()
    assert cache.flush_errors == 1


def test_memory_only_cache_persists_nothing(tmp_path: Path) -> None:
    with Cache([MemoryStore()], settings=Settings.load(dir=str(tmp_path))) as cache:
        cache.get_or_compile("k", lambda: b"x")
    assert list(tmp_path.iterdir()) == []


def test_forked_child_does_not_count_the_parents_work_twice(cache: Cache, cache_dir: Path) -> None:
    cache.get_or_compile("k", lambda: b"x")  # unflushed in the parent at fork time
    pid = os.fork()
    if pid == 0:  # child: a hit of its own, then flush and leave without atexit
        code = 0
        try:
            cache.get("k")
            cache.flush_stats()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    cache.flush_stats()
    t = tiers(cache_dir)
    assert t["memory"]["hits"] == 1
    assert t["memory"]["puts"] == 1
    assert t["memory"]["misses"] == 1


@pytest.mark.slow
def test_two_processes_add_up_in_kernelcache_stats(cache_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    for key, hits in (("k1", 5), ("k2", 7)):
        opts = {"dir": str(cache_dir), "key": key, "counter": str(tmp_path / "n"), "hits": hits}
        subprocess.run(
            [sys.executable, WORKER, json.dumps(opts)],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
    out = subprocess.run(
        [sys.executable, "-m", "kernelcache", "--dir", str(cache_dir), "stats", "--json"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(out.stdout)
    period = report["period"]
    assert period["tiers"]["memory"]["hits"] == 12
    assert period["tiers"]["memory"]["misses"] == 2
    assert period["tiers"]["disk"]["puts"] == 2
    assert period["compile"]["compiles"] == 2
    assert report["entries"] == 2
    assert period["tiers"]["memory"]["hit_rate"] == pytest.approx(12 / 14)
