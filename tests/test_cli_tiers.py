"""The command line sees the tiers a user's settings configure: caps, SQLite, Redis."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_run import kc, kc_json
from kernelcache import Cache, Entry, Settings
from kernelcache.stores.redis import RedisStore
from redis_server import RedisServer


def fill(settings: Settings, count: int, size: int) -> list[str]:
    keys = [f"k{i:03d}" for i in range(count)]
    with Cache(settings=settings) as cache:
        for i, key in enumerate(keys):
            cache.put(key, Entry({"kernel.cubin": bytes([i % 251]) * size}))
    return keys


def test_the_sqlite_tier_is_seen_by_every_command(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c"), "KERNELCACHE_LOCAL": "sqlite"}
    keys = fill(Settings.load(environ=env), 4, 1000)
    assert (tmp_path / "c" / "cache.sqlite").is_file()
    assert not (tmp_path / "c" / "v1" / "entries").exists()
    rows = kc_json("ls", env=env)
    assert sorted(r["key"] for r in rows) == keys
    assert {r["tier"] for r in rows} == {"sqlite"}
    assert kc_json("show", keys[0], env=env)["tier"] == "sqlite"
    stats = kc_json("stats", env=env)
    assert stats["usage"]["sqlite"]["entries"] == 4
    assert stats["lifetime"]["tiers"]["sqlite"]["puts"] == 4
    assert kc_json("verify", env=env) == {"checked": 4, "bad": []}
    bundle = tmp_path / "b.kcb"
    assert kc("export", str(bundle), env=env).returncode == 0
    assert kc("clear", "--yes", env=env).returncode == 0
    assert kc_json("ls", env=env) == []
    assert kc("import", str(bundle), env=env).returncode == 0
    assert sorted(r["key"] for r in kc_json("ls", env=env)) == keys
    pruned = kc("prune", "--max-entries", "1", env=env)
    assert pruned.returncode == 0
    assert "removed 3 entries" in pruned.stdout
    assert len(kc_json("ls", env=env)) == 1


def test_import_and_prune_keep_the_configured_cap(tmp_path: Path) -> None:
    source = {"KERNELCACHE_DIR": str(tmp_path / "src")}
    fill(Settings.load(environ=source), 100, 20_000)  # 2 MB
    bundle = tmp_path / "b.kcb"
    assert kc("export", str(bundle), env=source).returncode == 0
    capped = {"KERNELCACHE_DIR": str(tmp_path / "dst"), "KERNELCACHE_MAX_SIZE": "1M"}
    assert kc("import", str(bundle), env=capped).returncode == 0
    usage = kc_json("stats", env=capped)["usage"]["disk"]
    assert 0 < usage["bytes"] <= usage["max_bytes"] == 1 << 20
    on_disk = sum(r["size"] for r in kc_json("ls", env=capped))
    assert on_disk <= 1 << 20


def test_prune_reports_what_really_remains(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c")}
    fill(Settings.load(environ=env), 10, 100_000)
    out = kc("prune", "--max-size", "300K", env=env)
    assert out.returncode == 0, out.stderr
    remaining = kc_json("ls", env=env)
    said = out.stdout.split(";")[1].split()[0]
    assert int(said) == len(remaining)
    assert sum(r["size"] for r in remaining) <= 300 << 10


def test_the_remote_tier_is_listed_and_looking_changes_nothing(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    url = f"{redis_server.url}?namespace=cli{os.getpid()}"
    env = {"KERNELCACHE_DIR": str(tmp_path / "c"), "KERNELCACHE_REMOTE": url}
    with RedisStore(url) as remote:
        remote.put("only-remote", Entry({"a": b"team"}))
        rows = kc_json("ls", env=env)
        assert [(r["key"], r["tier"]) for r in rows] == [("only-remote", "redis")]
        assert kc_json("show", "only-remote", env=env)["tier"] == "redis"
        assert not (tmp_path / "c").exists()  # looking never creates the local tier
        assert kc("clear", "--yes", "--remote", env=env).returncode == 0
        assert remote.get("only-remote") is None


@pytest.mark.parametrize("value", ["lmdb", "1"])
def test_an_unknown_local_tier_is_a_config_error(tmp_path: Path, value: str) -> None:
    out = kc("stats", env={"KERNELCACHE_DIR": str(tmp_path), "KERNELCACHE_LOCAL": value})
    assert out.returncode == 2
    assert "KERNELCACHE_LOCAL must be one of disk, sqlite" in out.stderr
