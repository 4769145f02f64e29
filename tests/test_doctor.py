"""``kernelcache doctor``: all OK on a healthy set-up; each problem named, with its fix and a
non-zero exit (issue 38). Real parts: a redis-server, a FUSE network filesystem, nvcc."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import netfs
from kernelcache import doctor
from kernelcache.cli.main import main
from kernelcache.entry import Entry
from kernelcache.keys import KeyBuilder
from kernelcache.settings import Settings
from redis_server import LOADED, RedisServer

SECRET = "team-secret-for-tests"


def _env(cache_dir: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCACHE_")}
    env.pop("TRITON_CACHE_MANAGER", None)
    return {**env, "KERNELCACHE_DIR": str(cache_dir), **more}


def _signed_team(server: RedisServer, ns: str) -> str:
    """A team tier holding one entry signed with :data:`SECRET`; returns its URL."""
    from kernelcache.stores.redis import RedisStore

    # Generous: these tests are not about timeouts (redis_server.LOADED).
    url = f"{server.url}?namespace={ns}&timeout={LOADED:g}"
    with RedisStore(url, secret=SECRET) as store:
        store.put(KeyBuilder("t.doctor").add("n", 1).hexdigest(), Entry({"x": b"1"}))
    return url


def _problems(checks: list[doctor.Check]) -> list[tuple[str, str]]:
    return [(c.area, c.name) for c in checks if c.status == "problem"]


def test_a_healthy_machine_is_all_ok(
    tmp_path: Path, redis_server: RedisServer, ns: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    env = _env(tmp_path / "cache", KERNELCACHE_REMOTE=_signed_team(redis_server, ns),
               KERNELCACHE_SECRET=SECRET)  # fmt: skip
    checks = doctor.run(env)
    assert _problems(checks) == []
    by_name = {(c.area, c.name): c for c in checks}
    assert by_name["team", "reachable"].detail.endswith(" ms")
    assert by_name["team", "cluster"].detail == "a single server (not a Cluster)"
    assert "signed entries readable (1 read)" in by_name["team", "secret"].detail
    assert by_name["cache", "directory"].status == "ok"
    assert by_name["cache", "filesystem"].detail.endswith("(local)")
    for name in ("tilelang", "ninetoothed", "torch.compile"):
        assert "is tested" in by_name["integration", name].detail
    # The command: one line per check, "all OK", exit 0; --json says the same.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("all OK")
    assert "OK       team: reachable" in out
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert len(report["checks"]) == len(checks)


def test_a_typo_in_the_url(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNELCACHE_REMOTE", "redis://127.0.0.1:6390/0?timout=1")
    checks = doctor.run(_env(tmp_path / "cache", KERNELCACHE_REMOTE="redis://h:1/0?timout=1"))
    (bad,) = [c for c in checks if c.status == "problem"]
    assert (bad.area, bad.name) == ("settings", "KERNELCACHE_REMOTE")
    assert "did you mean 'timeout'" in bad.detail
    assert bad.fix == "correct or unset KERNELCACHE_REMOTE"
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  settings: KERNELCACHE_REMOTE" in out
    assert "fix: correct or unset KERNELCACHE_REMOTE" in out
    assert out.rstrip().endswith("1 problem")


def test_redis_down(tmp_path: Path, own_redis: RedisServer) -> None:
    url = own_redis.url
    own_redis.stop()
    checks = doctor.run(_env(tmp_path / "cache", KERNELCACHE_REMOTE=url))
    assert _problems(checks) == [("team", "reachable")]
    (down,) = [c for c in checks if c.status == "problem"]
    assert "Connection refused" in down.detail or "connecting" in down.detail
    assert down.fix is not None
    assert "server runs" in down.fix


def test_a_missing_secret_with_a_signed_team(
    tmp_path: Path, redis_server: RedisServer, ns: str
) -> None:
    checks = doctor.run(_env(tmp_path / "cache", KERNELCACHE_REMOTE=_signed_team(redis_server, ns)))
    assert _problems(checks) == [("team", "secret")]
    (missing,) = [c for c in checks if c.status == "problem"]
    assert "signed, and KERNELCACHE_SECRET is not set" in missing.detail
    assert missing.fix is not None
    assert "export KERNELCACHE_SECRET" in missing.fix
    wrong = doctor.run(_env(tmp_path / "cache", KERNELCACHE_REMOTE=_signed_team(redis_server, ns),
                            KERNELCACHE_SECRET="another"))  # fmt: skip
    assert [c.detail for c in wrong if c.status == "problem"] == [
        "1 of the entries read fail this machine's KERNELCACHE_SECRET"
    ]


def test_an_unsupported_tool_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ninetoothed")
    # ninetoothed as another release would show it: its metadata first on the path.
    site = tmp_path / "site"
    info = site / "ninetoothed-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ninetoothed\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("KERNELCACHE_STRICT_VERSIONS", "1")
    checks = doctor.run(_env(tmp_path / "cache"))
    assert _problems(checks) == [("integration", "ninetoothed")]
    (refused,) = [c for c in checks if c.status == "problem"]
    assert "ninetoothed 0.1.0 is outside the tested" in refused.detail
    assert refused.fix is not None
    assert "install ninetoothed 0.24 to 0.26" in refused.fix
    monkeypatch.delenv("KERNELCACHE_STRICT_VERSIONS")
    untested = {c.name: c for c in doctor.integrations(os.environ)}["ninetoothed"]
    assert (untested.status, "untested" in untested.detail) == (
        "note",
        True,
    )  # a warning, not a problem


def test_a_directory_on_a_network_filesystem(
    tmp_path: Path, two_nodes: Callable[..., netfs.NetFS]
) -> None:
    fs = two_nodes()
    checks = list(doctor.cache_dir(Settings.load(environ={}, dir=str(fs.nodes[0].path))))
    assert _problems(checks) == [("cache", "filesystem")]
    (network,) = [c for c in checks if c.status == "problem"]
    assert "a network filesystem" in network.detail
    assert network.fix is not None
    assert "KERNELCACHE_REMOTE" in network.fix


def test_a_directory_writable_by_others(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    checks = doctor.run(_env(shared / "cache"))
    assert _problems(checks) == [("cache", "directory")]
    (open_dir,) = [c for c in checks if c.status == "problem"]
    assert "writable by group or others" in open_dir.detail
    assert open_dir.fix is not None
    assert "chmod go-w" in open_dir.fix


def test_notes_and_the_launcher_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelcache.nvcc import native

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    checks = {(c.area, c.name): c for c in doctor.run(_env(
        cache_dir, KERNELCACHE_DISABLE="1", KERNELCACHE_COMPILED_CLIENT="0"))}  # fmt: skip
    assert checks["cache", "caching"].status == "note"  # disabled: said, with its fix
    assert checks["cache", "caching"].fix == "unset KERNELCACHE_DISABLE"
    assert checks["launcher", "client"].detail.startswith("KERNELCACHE_COMPILED_CLIENT is off")
    # A client whose build failed is a problem; one that runs here is OK.
    tag = native.platform_tag()
    if tag is None:
        pytest.skip("the compiled client is built on Linux only")
    with open(native.SOURCE, "rb") as f:
        name = native.binary_name(f.read(), tag)
    (cache_dir / f"{name}.failed").write_text("cc: not found\n")
    client = {c.name: c for c in doctor.launcher(Settings.load(environ={}, dir=str(cache_dir)), {
        "PATH": os.environ["PATH"]})}["client"]  # fmt: skip
    assert (client.status, client.detail) == (
        "problem",
        f"its build failed: see {cache_dir / name}.failed",
    )
    # Too little free space for entries to fit.
    monkeypatch.setattr(doctor, "MIN_FREE_BYTES", 1 << 62)
    space = {c.name: c for c in doctor.cache_dir(Settings.load(environ={}, dir=str(cache_dir)))}
    assert space["free space"].status == "problem"
