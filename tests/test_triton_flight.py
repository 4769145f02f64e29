"""One compile per Triton kernel across processes and machines, and a failed holder never blocks.

Real Triton compiles (sm_90, ahead of time) in spawned processes
(tests/triton_stampede.py). Compiles are counted by the kernel's
``tl.static_print``, which prints only when Triton really compiles it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from redis_server import RedisServer, unique_namespace

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
MANAGER = "kernelcache.triton:CacheManager"
STALLING = "triton_stampede:StallingManager"
VARIANTS = [1, 2, 3, 4]


def _env(tmp: Path, cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "KERNELCACHE_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]),
        TRITON_DEFAULT_FP_FUSION="1",  # else Triton 3.9 warns on every compile
        TRITON_HOME=str(tmp / "home"),
        TRITON_CACHE_DIR=str(cache_dir),
        TRITON_CACHE_MANAGER=MANAGER,
        KERNELCACHE_DIR=str(tmp / "unused-kernelcache-dir"),
    )
    env.update(extra)
    return env


_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_stray_processes() -> Iterator[None]:
    """A failing test must not leave its holders and waiters behind."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _start(env: dict[str, str], **opts: Any) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "triton_stampede.py"), json.dumps(opts)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _started.append(proc)
    return proc


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.splitlines()[0])
    return result


def _stampede(envs: list[dict[str, str]], tmp: Path) -> list[dict[str, Any]]:
    barrier = tmp / "barrier"
    procs = [
        _start(env, variants=VARIANTS, barrier=str(barrier), parties=len(envs)) for env in envs
    ]
    return [_finish(p) for p in procs]


def _assert_one_compile_each(results: list[dict[str, Any]]) -> None:
    assert all(not r["errors"] for r in results), [r["errors"] for r in results]
    for variant in map(str, VARIANTS):
        compiles = [r["variants"][variant]["compiles"] for r in results]
        assert sum(compiles) == 1, (variant, compiles)
        files = [r["variants"][variant]["files"] for r in results]
        assert all(f == files[0] for f in files), variant  # identical bytes everywhere
        assert any(name.endswith(".cubin") for name in files[0])


@pytest.mark.slow
def test_four_processes_compile_each_variant_once(tmp_path: Path) -> None:
    env = _env(tmp_path, tmp_path / "cache")
    results = _stampede([env] * 4, tmp_path)
    _assert_one_compile_each(results)
    stats = [r["compile_stats"] for r in results]
    # One compile each in the statistics too (with its compile_seconds).
    assert sum(s["compiles"] for s in stats) == len(VARIANTS)
    assert all(s["lock_timeouts"] == 0 for s in stats)
    # Those that did not compile a variant waited for it (or found it published).
    assert sum(r["counters"]["group_misses"] for r in results) == len(VARIANTS)
    assert _finish(_start(env, variants=VARIANTS))["compiles"] == 0  # and a later process hits


@pytest.mark.slow
def test_two_machines_sharing_redis_compile_each_variant_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    remote = redis_server.team_url(unique_namespace())
    machines = [_env(tmp_path, tmp_path / f"machine-{m}", KERNELCACHE_REMOTE=remote) for m in "ab"]
    results = _stampede([machines[0], machines[1]] * 2, tmp_path)
    _assert_one_compile_each(results)
    # Each machine's directory now holds every group: a fresh process there hits.
    for env in machines:
        again = _finish(_start(env, variants=VARIANTS))
        assert again["compiles"] == 0


def _hold(tmp: Path, env: dict[str, str], linger: bool = False) -> subprocess.Popen[str]:
    """A holder that takes the claim of variant 1 and stops mid-compile."""
    holding = tmp / "holding"
    holder_env = {
        **env,
        "TRITON_CACHE_MANAGER": STALLING,
        "KC_TEST_HOLDING": str(holding),
        "KC_TEST_GO": str(tmp / "go"),
    }
    opts: dict[str, Any] = {"variants": [1]}
    if linger:
        opts["linger"] = str(tmp / "quit")
    holder = _start(holder_env, **opts)
    deadline = time.monotonic() + 120
    while not holding.exists():
        assert holder.poll() is None, holder.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the holder never took its claim"
        time.sleep(0.01)
    return holder


def _waiters(tmp: Path, env: dict[str, str], n: int) -> list[subprocess.Popen[str]]:
    """``n`` processes asking for the held variant; returns once they are about to ask."""
    ready = [tmp / f"ready-{i}" for i in range(n)]
    procs = [_start(env, variants=[1], ready=str(r)) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "the waiters never started"
        time.sleep(0.01)
    time.sleep(0.5)  # they reach the claim within milliseconds; a late one just finds it free
    return procs


def _assert_waiters_compiled_once(results: list[dict[str, Any]]) -> None:
    assert all(not r["errors"] for r in results)
    assert sum(r["variants"]["1"]["compiles"] for r in results) == 1
    # The claim was released for them: none waited out its own (long) timeout.
    assert all(r["compile_stats"]["lock_timeouts"] == 0 for r in results)


@pytest.mark.slow
def test_holder_killed_mid_compile_a_waiter_compiles(tmp_path: Path) -> None:
    env = _env(tmp_path, tmp_path / "cache", KERNELCACHE_TRITON_TIMEOUT="200")
    holder = _hold(tmp_path, env)
    waiters = _waiters(tmp_path, env, 2)
    holder.send_signal(signal.SIGKILL)
    holder.communicate()
    _assert_waiters_compiled_once([_finish(w) for w in waiters])


@pytest.mark.slow
def test_holder_compile_raises_the_waiters_go_on(tmp_path: Path) -> None:
    env = _env(tmp_path, tmp_path / "cache", KERNELCACHE_TRITON_TIMEOUT="200")
    holder = _hold(tmp_path, env, linger=True)  # stays alive: only dropping the manager frees it
    waiters = _waiters(tmp_path, env, 1)
    (tmp_path / "go").write_text("raise")
    _assert_waiters_compiled_once([_finish(w) for w in waiters])
    (tmp_path / "quit").touch()
    failed = _finish(holder)
    assert failed["errors"] == {"1": "injected compile failure"}
    assert failed["counters"]["claims_abandoned"] == 1


@pytest.mark.slow
def test_stuck_holder_releases_its_claim_at_its_timeout(tmp_path: Path) -> None:
    env = _env(tmp_path, tmp_path / "cache", KERNELCACHE_TRITON_TIMEOUT="200")
    # The holder never finishes and never dies (as if a traceback kept its manager).
    _hold(tmp_path, {**env, "KERNELCACHE_TRITON_TIMEOUT": "3"})  # killed at teardown
    waiters = _waiters(tmp_path, env, 1)
    _assert_waiters_compiled_once([_finish(w) for w in waiters])


@pytest.mark.slow
def test_forked_workers_leave_no_staging_directories(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = _env(tmp_path, tmp_path / "cache", TMPDIR=str(tmpdir))
    result = _finish(_start(env, variants=VARIANTS, fork=2))
    assert set(result["variants"]) == set(map(str, VARIANTS))
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("kernelcache-triton-")] == []
