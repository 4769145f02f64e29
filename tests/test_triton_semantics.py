"""Triton's own cache semantics through kernelcache, and the claims a manager holds, in process.

Where the cache lives (``TRITON_CACHE_DIR``, the knob, ``KERNELCACHE_TRITON_DIR``),
a removed or fresh directory is a cold cache, compile time is recorded for
``kernelcache stats``, and a claim taken at a ``get_group`` miss is never leaked:
released at ``put_group``, when the manager is dropped, at its timeout, and
never by a forked child.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("triton")

import triton

import kernelcache.triton as kt
import triton_kernels
from kernelcache import Cache, DiskStore, _fs

ROOT = Path(__file__).resolve().parent.parent
FILES = {"k.source": b"module {}", "k.cubin": b"\x7fELF\x00\x01", "k.json": b'{"name": "k"}'}


@pytest.fixture(autouse=True)
def triton_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """kernelcache as Triton's manager, configured the way users do: by the environment."""
    for name in [n for n in os.environ if n.startswith(("TRITON_", "KERNELCACHE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "kernelcache.triton:CacheManager")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "kernelcache-dir"))
    monkeypatch.setenv(kt.ENV_TIMEOUT, "30")
    kt.set_cache(None)
    yield tmp_path / "triton-cache"
    kt.set_cache(None)


def _inside(paths: dict[str, str], folder: Path) -> bool:
    return all(Path(p).is_relative_to(folder) for p in paths.values())


# Where the cache lives ------------------------------------------------------
def test_the_disk_tier_lives_in_tritons_cache_dir(triton_env: Path, tmp_path: Path) -> None:
    kernel, seen = triton_kernels.compile_kernel("add")
    assert seen["cache_hit"] is False
    assert _inside(kernel.metadata_group, triton_env)
    assert not (tmp_path / "kernelcache-dir").exists()
    assert kt.current().directory == str(triton_env)


def test_tritons_knob_sets_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    knob_dir = tmp_path / "knob"
    with triton.knobs.cache.scope():
        # Set on the knob alone, as Triton's fresh_triton_cache fixture may do.
        monkeypatch.setattr(triton.knobs, "propagate_env", False)
        triton.knobs.cache.dir = str(knob_dir)
        assert os.environ["TRITON_CACHE_DIR"] != str(knob_dir)
        kernel, _ = triton_kernels.compile_kernel("add")
    assert _inside(kernel.metadata_group, knob_dir)


def test_kernelcache_triton_dir_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kt.ENV_DIR, str(tmp_path / "own"))
    assert kt.current().directory == str(tmp_path / "own")


def test_unset_triton_dir_means_the_shared_kernelcache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert kt.current().directory == str(tmp_path / "kernelcache-dir")


@pytest.mark.usefixtures("pins_at_once")
def test_a_removed_directory_is_a_cold_cache(triton_env: Path) -> None:
    first, seen = triton_kernels.compile_kernel("softmax")
    assert seen["cache_hit"] is False
    for _ in range(2):  # pinned by the publish or by the first hit: the second is pinned
        _, seen = triton_kernels.compile_kernel("softmax")
        assert seen["cache_hit"] is True
    assert kt.stats()["pinned"]["hits"] >= 1  # served from this process's pins, even so
    shutil.rmtree(triton_env)
    again, seen = triton_kernels.compile_kernel("softmax")
    assert seen["cache_hit"] is False
    assert seen["stages"]
    assert again.asm["cubin"] == first.asm["cubin"]
    assert _inside(again.metadata_group, triton_env)
    _, seen = triton_kernels.compile_kernel("softmax")
    assert seen["cache_hit"] is True


def test_a_fresh_directory_is_a_cold_cache(
    triton_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert triton_kernels.compile_kernel("add")[1]["cache_hit"] is False
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    assert triton_kernels.compile_kernel("add")[1]["cache_hit"] is False
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_env))
    assert triton_kernels.compile_kernel("add")[1]["cache_hit"] is True


@pytest.fixture
def pins_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files vouch for themselves at once (else only once older than the timestamp granularity)."""
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)


# Statistics -------------------------------------------------------------
def test_compile_time_is_recorded_and_kernelcache_stats_shows_seconds_saved(
    triton_env: Path,
) -> None:
    assert triton_kernels.compile_kernel("add")[1]["cache_hit"] is False
    for _ in range(2):
        assert triton_kernels.compile_kernel("add")[1]["cache_hit"] is True
    cache = kt.get_cache()
    compiled = cache.compile_stats()
    assert compiled["compiles"] == 1
    assert compiled["compile_seconds"] > 0
    assert sum(tier["seconds_saved"] for tier in cache.stats().values()) > 0
    cache.flush_stats()
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "--dir", str(triton_env), "stats", "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    period = json.loads(proc.stdout)["period"]
    assert period["compile"]["compiles"] == 1
    assert sum(tier["seconds_saved"] for tier in period["tiers"].values()) > 0


# Claims -------------------------------------------------------------------
def _in_thread(fn: object) -> dict[str, object]:
    """Run ``fn`` in another thread (a claim of this thread would not be waited for)."""
    out: dict[str, object] = {}

    def run() -> None:
        out["result"] = fn()  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    return out


def _publish(manager: kt.CacheManager) -> dict[str, str]:
    group = {name: manager.put(data, name) for name, data in FILES.items()}
    manager.put_group("k.json", group)
    return group


def test_another_thread_waits_for_the_compile_and_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelcache import singleflight

    waiting = threading.Event()
    real_wait = singleflight.Flight.wait

    def wait(flight: singleflight.Flight) -> bool:
        waiting.set()  # the waiter joined the holder's flight: what it publishes is handed over
        return real_wait(flight)

    monkeypatch.setattr(singleflight.Flight, "wait", wait)
    before = kt.counters()
    holder = kt.CacheManager("K")
    assert holder.get_group("k.json") is None
    waiter = threading.Thread(target=lambda: found.append(kt.CacheManager("K").get_group("k.json")))
    found: list[dict[str, str] | None] = []
    waiter.start()
    # Published only once the waiter waits: a waiter that a loaded machine started after
    # a fixed sleep found the group published, a hit without a wait (group_waits 0).
    assert waiting.wait(60), "the other thread never waited for the holder"
    published = _publish(holder)
    waiter.join(60)
    assert found == [published]  # files inside the cache, not private copies
    after = kt.counters()
    assert after["group_misses"] - before["group_misses"] == 1
    assert after["group_waits"] - before["group_waits"] == 1


def test_a_dropped_manager_abandons_its_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kt.ENV_TIMEOUT, "5")  # were it leaked, the waiter would time out
    kt.set_cache(None)
    before = kt.counters()["claims_abandoned"]
    manager = kt.CacheManager("K")
    assert manager.get_group("k.json") is None
    staged = Path(manager.put(b"half", "k.ttir"))
    del manager  # what Triton does when the compile raises
    gc.collect()
    assert not staged.exists()
    assert kt.counters()["claims_abandoned"] == before + 1
    assert _in_thread(lambda: kt.CacheManager("K").get_group("k.json")) == {"result": None}
    assert kt.get_cache().compile_stats()["lock_timeouts"] == 0


class _CollectingKey(str):
    """A key whose hashing runs the cyclic collector: a collection inside the flight table's lock."""

    __slots__ = ()

    def __hash__(self) -> int:
        gc.collect()
        return str.__hash__(self)


def test_a_manager_freed_by_the_cyclic_collector_releases_its_claim_without_deadlock() -> None:
    before = kt.counters()["claims_abandoned"]
    gc.disable()  # the garbage below waits for the collection we start on purpose
    try:
        manager = kt.CacheManager("K")
        assert manager.get_group("k.json") is None
        manager.cycle = manager  # only the collector can free it
        del manager
        cache = kt.get_cache()

        def ask() -> None:
            # The collection runs while this thread holds the flight table's lock;
            # releasing the claim there would wait for that lock forever.
            with cache.claim(_CollectingKey("0" * 64), timeout=5):
                pass
            done.append(True)

        done: list[bool] = []
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(60)
    finally:
        gc.enable()
    assert done == [True]
    deadline = time.monotonic() + 60
    while kt.counters()["claims_abandoned"] == before:  # released by the reaper thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _in_thread(lambda: kt.CacheManager("K").get_group("k.json")) == {"result": None}


def test_the_same_thread_asking_again_abandons_its_stale_claim() -> None:
    kept = kt.CacheManager("K")  # a traceback kept the failed compile's manager alive
    assert kept.get_group("k.json") is None
    again = kt.CacheManager("K")
    assert again.get_group("k.json") is None  # no wait for ourselves, no RuntimeError
    assert kt.counters()["claims_abandoned"] >= 1
    _publish(again)
    assert kt.CacheManager("K").get_group("k.json") is not None


def test_a_claim_expires_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kt.ENV_TIMEOUT, "0.3")
    kt.set_cache(None)
    stuck = kt.CacheManager("K")
    assert stuck.get_group("k.json") is None
    deadline = time.monotonic() + 60
    while kt.counters()["claims_expired"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _in_thread(lambda: kt.CacheManager("K").get_group("k.json")) == {"result": None}
    # The stuck compile still publishes when it finishes: a put, not a claim any more.
    _publish(stuck)
    assert kt.CacheManager("K").get_group("k.json") is not None


def test_a_forked_child_neither_holds_nor_releases_the_claim(triton_env: Path) -> None:
    holder = kt.CacheManager("K")
    assert holder.get_group("k.json") is None
    staged = holder.put(b"stage", "k.source")
    key = kt.current().key("group", "K", "k.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: drop the inherited manager, then look at the lock
        code = 1
        try:
            del holder
            gc.collect()
            probe = Cache([DiskStore(triton_env)], persist_stats=False)
            with probe.claim(key, timeout=0.2):
                pass
            still_held = probe.compile_stats()["lock_timeouts"] == 1
            code = 0 if still_held and os.path.exists(staged) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    group = {
        "k.source": staged,
        **{n: holder.put(d, n) for n, d in FILES.items() if n != "k.source"},
    }
    holder.put_group("k.json", group)
    assert kt.get_cache().compile_stats()["compiles"] == 1  # published through the claim
