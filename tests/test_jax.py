"""kernelcache.jax with real ``jax.jit`` compiles on CPU, in child processes and in process.

A "machine" is a process with a local cache directory of its own; machines
share the suite's Redis. The team (machine A's compile, signed with the
team's secret) is made once per module and reused; tests that damage the
team's entries make their own. Each child counts JAX's own cache events
(tests/jax_worker.py) and turns every warning into an error, so a
"persistent cache error" warning from JAX fails it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import children  # noqa: E402
import kernelcache.jax as kcj  # noqa: E402
from disk_entries import damage_every_entry, stored_keys  # noqa: E402
from kernelcache import _jax_autoload  # noqa: E402
from kernelcache.bytecache import VALUE  # noqa: E402
from kernelcache.cache import Cache  # noqa: E402
from kernelcache.entry import Entry  # noqa: E402
from kernelcache.jax import backend, keys  # noqa: E402
from kernelcache.stores.disk import DiskStore  # noqa: E402
from kernelcache.stores.memory import MemoryStore  # noqa: E402
from redis_server import RedisServer, unique_namespace  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "jax_worker.py"
SECRET = "team-secret-for-tests"
TRUST = {"KERNELCACHE_JAX_TRUST_UNSIGNED": "1"}


def machine(tmp: Path, name: str, remote: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELCACHE_", "JAX_"))}
    env.update(
        KERNELCACHE_DIR=str(tmp / name / "kc"),
        PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]),
        **extra,
    )
    if remote is not None:
        env["KERNELCACHE_REMOTE"] = remote
    return env


def run(env: dict[str, str]) -> dict[str, Any]:
    report = children.finish(children.start(WORKER, env))
    assert report["equal"], "the compiled result equals numpy's"
    return report


class Team:
    def __init__(self, tmp: Path, server: RedisServer) -> None:
        self.tmp, self.namespace = tmp, unique_namespace()
        self.remote = server.team_url(self.namespace)
        self.first = run(self.env("a"))

    def env(self, name: str, **extra: str) -> dict[str, str]:
        return machine(self.tmp, name, self.remote, KERNELCACHE_SECRET=SECRET, **extra)


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Team:
    return Team(tmp_path_factory.mktemp("team"), redis_server)


def test_a_second_machine_hits_by_jax_own_events(team: Team) -> None:
    assert team.first["jax"] == {"hits": 0, "writes": 1}
    assert team.first["kc"]["misses"] == team.first["kc"]["puts"] == 1
    assert team.first["compile"]["compiles"] == 1
    # The environment-only way: no install() in the script (KC_TEST_INSTALL=0).
    second = run(team.env("b", KERNELCACHE_JAX="1", KC_TEST_INSTALL="0"))
    assert second["installed"]
    assert second["jax"] == {"hits": 1, "writes": 0}
    assert second["kc"]["hits"] == 1
    assert second["compile"]["compiles"] == 0


def test_a_machine_without_the_secret_loads_nothing_from_the_team(team: Team) -> None:
    env = team.env("keyless")
    del env["KERNELCACHE_SECRET"]
    report = run(env)
    assert report["jax"] == {"hits": 0, "writes": 1}, "compiled: the team entry was not read"
    assert report["kc"]["team_refused"] == 1


def _flip_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def test_corrupt_disk_entries_are_recompiled(team: Team, tmp_path: Path) -> None:
    local = tmp_path / "m" / "kc"
    shutil.copytree(team.tmp / "a" / "kc", local)
    damaged = damage_every_entry(local, _flip_bytes)
    assert damaged == 1
    report = run(machine(tmp_path, "m", None))  # no team tier: the disk alone
    assert report["jax"] == {"hits": 0, "writes": 1}
    # and the entry written in its place is whole again
    assert run(machine(tmp_path, "m", None))["jax"] == {"hits": 1, "writes": 0}


def test_corrupt_redis_values_are_recompiled(team: Team, raw: Any) -> None:
    # Damages the team's entries: the last test of this module to use them.
    damaged = 0
    for name in raw.scan_iter(match=f"kc:{team.namespace}:*"):
        value = raw.get(name)
        if isinstance(value, bytes) and len(value) > 256:
            raw.set(name, _flip_bytes(value), keepttl=True)
            damaged += 1
    assert damaged == 1
    report = run(team.env("fresh"))
    assert report["jax"] == {"hits": 0, "writes": 1}


@pytest.mark.slow
def test_four_processes_released_together_compile_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    remote = redis_server.team_url(unique_namespace())
    go = tmp_path / "go"
    procs = [
        children.start(
            WORKER, machine(tmp_path, f"m{i}", remote, KERNELCACHE_SECRET=SECRET), str(go)
        )
        for i in range(4)
    ]
    children.release(go, procs)
    reports = [children.finish(p) for p in procs]
    assert all(r["equal"] for r in reports)
    assert sum(r["jax"]["writes"] for r in reports) == 1
    assert sum(r["jax"]["hits"] for r in reports) == 3
    assert sum(r["compile"]["compiles"] for r in reports) == 1


def test_unsigned_team_entries_load_only_where_trusted(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    remote = redis_server.team_url(unique_namespace())
    writer = run(machine(tmp_path, "writer", remote, **TRUST))  # no secret: unsigned
    assert writer["jax"]["writes"] == 1
    # The test can fail: a machine that opts in loads the unsigned entry. It runs first:
    # the signed machine below replaces the entry with one of its own.
    assert run(machine(tmp_path, "trusting", remote, **TRUST))["jax"] == {"hits": 1, "writes": 0}
    keyless = children.start(WORKER, machine(tmp_path, "keyless", remote))
    signed = children.start(WORKER, machine(tmp_path, "signed", remote, KERNELCACHE_SECRET=SECRET))
    for report in (children.finish(keyless), children.finish(signed)):
        assert report["equal"]
        assert report["jax"] == {"hits": 0, "writes": 1}, "an unsigned executable was loaded"


def test_uninstall_leaves_jax_own_directory_cache_working(tmp_path: Path) -> None:
    env = machine(tmp_path, "m", None, KC_TEST_INSTALL="uninstall")
    env["KC_TEST_JAX_DIR"] = str(tmp_path / "jax-cache")
    first = run(env)
    assert first["jax"] == {"hits": 0, "writes": 1}
    assert not first["installed"]
    assert len(list((tmp_path / "jax-cache").iterdir())) == 1
    assert run(env)["jax"] == {"hits": 1, "writes": 0}
    assert not stored_keys(tmp_path / "m" / "kc"), "kernelcache stored nothing"


def test_a_slip_in_the_variable_is_one_line_and_jax_keeps_its_cache(tmp_path: Path) -> None:
    env = machine(tmp_path, "m", None, KERNELCACHE_JAX="yes", KC_TEST_INSTALL="0")
    proc = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "KERNELCACHE_JAX='yes' is neither 0 nor 1" in proc.stderr
    assert '"installed": false' in proc.stdout


def test_a_bad_setting_with_the_variable_is_one_line_and_jax_keeps_its_cache(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("KERNELCACHE_JAX", "1")
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.setenv("KERNELCACHE_REMOTE", "redis://127.0.0.1:1/0?bogus=1")
    kcj.uninstall()
    _jax_autoload.initialize()
    assert not kcj.installed()
    [line] = capsys.readouterr().err.splitlines()
    assert "KERNELCACHE_REMOTE" in line
    assert line.endswith("JAX keeps its own cache")


# In process ----------------------------------------------------------------------------
@pytest.fixture
def fresh_jax(tmp_path: Path) -> Iterator[Path]:
    """JAX's cache state and thresholds restored after the test; modules cached from 0 s."""
    from jax._src import compilation_cache as cc

    before = (
        jax.config.jax_persistent_cache_min_compile_time_secs,
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_enable_compilation_cache,
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
    try:
        yield tmp_path
    finally:
        kcj.uninstall()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[0])
        jax.config.update("jax_compilation_cache_dir", before[1])
        jax.config.update("jax_enable_compilation_cache", before[2])
        cc.reset_cache()


def _compile(scale: float) -> np.ndarray:
    """A module of its own for each ``scale`` (a constant in it), compiled afresh."""
    jax.clear_caches()  # JAX's in-memory caches: the next call asks the persistent cache
    x = np.arange(6, dtype=np.float32)
    return np.asarray(jax.jit(lambda v: v * scale + 1)(x))


def _cache(tmp: Path) -> Cache:
    return Cache([MemoryStore(), DiskStore(tmp / "kc")], persist_stats=False)


def test_install_and_uninstall_set_and_give_back_the_cache_global(fresh_jax: Path) -> None:
    from jax._src import compilation_cache as cc

    with kcj.enabled(_cache(fresh_jax)) as done:
        assert done
        ours = vars(cc)["_cache"]
        assert "kernelcache" in str(vars(ours)["_path"])
        np.testing.assert_allclose(_compile(2.0), np.arange(6) * 2.0 + 1)
        assert kcj.stats()["puts"] >= 1
    assert not kcj.installed()
    assert vars(cc)["_cache"] is None  # JAX builds its own again from jax_compilation_cache_dir


def test_enable_compilation_cache_false_keeps_kernelcache_out(fresh_jax: Path) -> None:
    jax.config.update("jax_enable_compilation_cache", False)
    with kcj.enabled(_cache(fresh_jax)):
        before = kcj.stats()
        _compile(3.0)
        assert kcj.stats() == before, "kernelcache never asked"


def test_a_foreign_value_under_the_key_is_a_miss_and_is_removed(
    fresh_jax: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _cache(fresh_jax)
    with kcj.enabled(cache):
        _compile(4.0)
        key = next(iter(cache.tiers[0].keys()))  # the memory tier's copy
        cache.put(key, Entry({VALUE: b"not an executable"}))
        before = kcj.stats()
        with caplog.at_level(logging.WARNING, "kernelcache.jax"):
            np.testing.assert_allclose(_compile(4.0), np.arange(6) * 4.0 + 1)
        after = kcj.stats()
    assert after["unusable"] == before["unusable"] + 1
    assert after["puts"] == before["puts"] + 1, "compiled again and stored"
    assert any("unusable entry" in r.getMessage() for r in caplog.records)


class _TeamTier(MemoryStore):
    """A tier that is neither in this process nor local: what a Redis tier looks like."""

    in_process = False
    shared = True

    def __init__(self, secret: str | None) -> None:
        super().__init__()
        self.secret = secret


@pytest.mark.parametrize(
    ("secret", "trust", "read"),
    [
        pytest.param(None, None, False, id="no-secret"),
        pytest.param(None, True, True, id="no-secret-opted-in"),
        pytest.param(SECRET, None, True, id="signed"),
    ],
)
def test_the_team_tier_is_read_only_when_signed_or_trusted(
    fresh_jax: Path,
    secret: str | None,
    trust: bool | None,
    read: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = _cache(fresh_jax)
    with kcj.enabled(writer):
        _compile(5.0)
    team = _TeamTier(secret)
    for tier in writer.tiers:
        for key in list(tier.keys()):
            entry = tier.get(key)
            assert entry is not None
            team.put(key, entry)
    reader = Cache([MemoryStore(), team], persist_stats=False)
    with (
        caplog.at_level(logging.WARNING, "kernelcache.jax"),
        kcj.enabled(reader, trust_unsigned=trust),
    ):
        before = kcj.stats()["hits"]
        _compile(5.0)
        assert (kcj.stats()["hits"] == before + 1) is read
    warned = [r for r in caplog.records if "KERNELCACHE_SECRET" in r.getMessage()]
    assert len(warned) == (0 if read else 1)


def test_a_compile_that_never_puts_gives_its_claim_up_when_it_ends(fresh_jax: Path) -> None:
    # Above the threshold, JAX compiles without a put: the claim must not stay.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 3600)
    with kcj.enabled(_cache(fresh_jax)):
        before = kcj.stats()
        _compile(6.0)
        stats = kcj.stats()
        assert stats["misses"] == before["misses"] + 1
        assert stats["puts"] == before["puts"]
        service = backend.current()
        assert service is not None
        assert service.flights.abandon_all() == 0, "no claim left open"


@pytest.mark.parametrize(
    ("compress", "name", "prefix"),
    [
        pytest.param(__import__("zlib").compress, "zlib", b"\x78", id="zlib"),
        pytest.param(lambda b: keys.ZSTD_MAGIC + b, "zstd", keys.ZSTD_MAGIC, id="zstd"),
        pytest.param(lambda b: b"LZ4!" + b, "unknown-4c5a3421", b"", id="unknown"),
    ],
)
def test_the_compression_is_probed_from_what_jax_writes(
    compress: Any, name: str, prefix: bytes
) -> None:
    assert keys.compression(compress) == (name, prefix)


BASE = keys.Setup("0.10.2", "0.10.2", "cpython-3.11", "x86_64", "zstd", keys.ZSTD_MAGIC)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"jax": "0.6.2"}, id="jax"),
        pytest.param({"jaxlib": "0.6.2"}, id="jaxlib"),
        pytest.param({"python": "cpython-3.14"}, id="python"),
        pytest.param({"machine": "aarch64"}, id="machine"),
        pytest.param({"compression": "zlib", "prefix": b"\x78"}, id="compression"),
    ],
)
def test_what_jax_leaves_out_of_its_key_is_in_ours(other: dict[str, Any]) -> None:
    import dataclasses

    changed = dataclasses.replace(BASE, **other)
    assert keys.entry_key(changed, "jit_f-abc") != keys.entry_key(BASE, "jit_f-abc")
    assert keys.entry_key(BASE, "jit_f-abc") == keys.entry_key(BASE, "jit_f-abc")
    assert keys.entry_key(BASE, "jit_f-abc") != keys.entry_key(BASE, "jit_f-abd")


def test_the_autoload_is_a_no_op_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELCACHE_JAX", raising=False)
    _jax_autoload.initialize()
    monkeypatch.setenv("KERNELCACHE_JAX", "0")
    _jax_autoload.initialize()
    assert not kcj.installed()


def test_a_process_that_never_writes_never_makes_others_wait() -> None:
    # JAX puts from process 0 only: another process's miss takes no claim.
    from kernelcache.bytecache import Service

    counts: dict[str, int] = {}

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    cache = Cache([MemoryStore()], persist_stats=False)
    service = Service(
        lambda: cache,
        count,
        lambda: 60.0,
        key=str,
        meta=lambda k: {},
        name="jax",
        leads=lambda: False,
    )
    try:
        assert service.get("jit_f-abc") is None
        assert service.flights.abandon_all() == 0, "no claim taken"
        with cache.claim("jit_f-abc", timeout=0) as claim:
            assert claim.leads, "nobody else holds the key"
        assert counts == {"misses": 1}
    finally:
        service.close()


def test_local_tiers_without_a_statistics_directory_are_not_team_tiers(tmp_path: Path) -> None:
    # A local SQLite file and a read-only disk tier keep no local_dir; they were once
    # taken for team tiers and left out of an unsigned machine's cache.
    from kernelcache.bytecache import is_team_tier, unsigned_team_tiers
    from kernelcache.stores.sqlite import SQLiteStore

    DiskStore(tmp_path / "d").close()
    tiers = [SQLiteStore(str(tmp_path / "c.sqlite")), DiskStore(tmp_path / "d", read_only=True)]
    cache = Cache(tiers, persist_stats=False)
    assert [is_team_tier(t) for t in tiers] == [False, False]
    assert unsigned_team_tiers(cache) == []
    assert unsigned_team_tiers(Cache([_TeamTier(None)], persist_stats=False)) != []
