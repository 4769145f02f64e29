"""The command line never surprises (issue 20, items 3-7): it touches the team tier only
when asked, refuses a limit of 0, tells the truth in read-only mode, says when no cache is
where it looks, and has what ccache and sccache users expect (--version, server, config)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import SRC, kc, kc_json
from kernelcache import Cache, Entry, Settings
from kernelcache.nvcc import control
from kernelcache.stores.redis import RedisStore
from launcher_env import clean_env, start_server, stop_server, wait_for
from redis_server import LOADED, RedisServer


def fill(env: dict[str, str], keys: list[str]) -> None:
    with Cache(settings=Settings.load(environ=env)) as cache:
        for i, key in enumerate(keys):
            cache.put(key, Entry({"a": bytes([i]) * 1000}))


def local_keys(env: dict[str, str]) -> list[str]:
    return sorted(r["key"] for r in kc_json("ls", env=env) if r["tier"] != "redis")


# Item 3: the team tier only with --remote ------------------------------------------------
@pytest.mark.parametrize("command", [["prune", "--max-entries", "1"], ["clear", "--yes"]])
def test_prune_and_clear_leave_the_team_tier_alone_unless_remote(
    tmp_path: Path, redis_server: RedisServer, ns: str, command: list[str]
) -> None:
    url = f"{redis_server.url}?namespace={ns}&timeout={LOADED:g}"  # not about timeouts
    env = {"KERNELCACHE_DIR": str(tmp_path / "c"), "KERNELCACHE_REMOTE": url}
    fill(env, ["k1", "k2", "k3"])  # written to disk and to Redis
    with RedisStore(url) as team:
        assert sorted(team.keys()) == ["k1", "k2", "k3"]
        out = kc(*command, env=env)
        assert out.returncode == 0, out.stderr
        assert sorted(team.keys()) == ["k1", "k2", "k3"]  # the team's entries stay
        assert len(local_keys(env)) == (1 if command[0] == "prune" else 0)
        out = kc(*command, "--remote", env=env)
        assert out.returncode == 0, out.stderr
        assert len(list(team.keys())) == (1 if command[0] == "prune" else 0)


# Item 4: 0 refused, --dry-run, --json ----------------------------------------------------
@pytest.mark.parametrize(
    "limit", [["--max-size", "0"], ["--max-size", "0K"], ["--max-entries", "0"]]
)
def test_a_limit_of_zero_is_refused_and_points_at_clear(tmp_path: Path, limit: list[str]) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c")}
    fill(env, ["k1", "k2"])
    out = kc("prune", *limit, env=env)
    assert out.returncode == 2
    assert "kernelcache clear" in out.stderr
    assert "KERNELCACHE_MAX_SIZE=0 means no cap" in out.stderr
    assert local_keys(env) == ["k1", "k2"]


def test_prune_dry_run_removes_nothing_and_says_what_would_go(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c")}
    fill(env, ["k1", "k2", "k3"])
    report = kc_json("prune", "--max-entries", "1", "--dry-run", env=env)
    assert (report["dry_run"], report["removed"], report["kept"]) == (True, 2, 1)
    assert local_keys(env) == ["k1", "k2", "k3"]
    human = kc("prune", "--max-entries", "1", "--dry-run", env=env)
    assert "would remove 2 entries" in human.stdout
    report = kc_json("prune", "--max-entries", "1", env=env)
    assert (report["dry_run"], report["removed"], report["kept"]) == (False, 2, 1)
    assert len(local_keys(env)) == 1


def test_export_import_and_clear_speak_json(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c")}
    fill(env, ["k1", "k2"])
    bundle = str(tmp_path / "b.kcb")
    exported = kc_json("export", bundle, env=env)
    assert (exported["exported"], exported["damaged"], exported["file"]) == (2, 0, bundle)
    cleared = kc_json("clear", "--yes", env=env)
    assert cleared == {"removed": 2, "tiers": ["disk"]}
    imported = kc_json("import", bundle, env=env)
    assert (imported["added"], imported["present"], imported["conflicts"]) == (2, 0, [])


# Item 5: a directory with no cache, a relative one, an unusable one ------------------------
@pytest.mark.parametrize(
    "command", [["ls"], ["stats"], ["verify"], ["prune", "--max-entries", "9"]]
)
def test_a_directory_without_a_cache_is_said_and_exits_1(
    tmp_path: Path, command: list[str]
) -> None:
    (tmp_path / "empty").mkdir()
    for where, said in ((tmp_path / "typo", "does not exist"), (tmp_path / "empty", "holds none")):
        out = kc("--dir", str(where), *command, env={})
        assert out.returncode == 1, out.stdout
        assert f"no cache at {where}" in out.stderr
        assert said in out.stderr
    assert not (tmp_path / "typo").exists()  # and looking created nothing


def test_a_relative_cache_directory_is_refused(tmp_path: Path) -> None:
    out = kc("stats", env={"KERNELCACHE_DIR": "rel/cache"})
    assert out.returncode == 2
    assert "KERNELCACHE_DIR must be an absolute path" in out.stderr
    # As an argument, it is resolved once, against the working directory.
    fill({"KERNELCACHE_DIR": str(tmp_path / "c")}, ["k1"])
    out = subprocess.run(
        [sys.executable, "-m", "kernelcache", "--dir", "c", "ls", "--json"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [r["key"] for r in json.loads(out.stdout)] == ["k1"]


@pytest.mark.parametrize("case", ["proc", "under-a-file"])
def test_an_unusable_directory_is_named_once_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    (tmp_path / "file").write_text("")
    path = "/proc/kc" if case == "proc" else str(tmp_path / "file" / "kc")
    with caplog.at_level(logging.WARNING, logger="kernelcache"):
        for _ in range(3):
            with Cache(settings=Settings.load(dir=path)) as cache:
                cache.put("k", Entry({"a": b"x"}))  # counted, not raised
    said = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(said) == 1
    reason = "Not a directory" if case == "under-a-file" else ""
    assert reason in said[0]
    assert "nothing is cached there" in said[0]


# Item 6: read-only mode tells the truth ---------------------------------------------------
def test_read_only_commands_that_would_change_the_cache_say_so(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path / "c")}
    fill(env, ["k1", "k2", "k3"])
    with Cache(settings=Settings.load(environ=env)) as cache:
        cache.get("k1")  # something in the statistics
    ro = {**env, "KERNELCACHE_READONLY": "1"}
    before = {p: p.read_bytes() for p in (tmp_path / "c").rglob("*") if p.is_file()}
    for command in (["prune", "--max-entries", "1"], ["clear", "--yes"], ["stats", "--zero"],
                    ["verify", "--fix"]):  # fmt: skip
        out = kc(*command, env=ro)
        assert out.returncode == 1, (command, out.stdout)
        assert "read-only" in out.stderr, command
        assert "removed 0" not in out.stdout
        assert "remain" not in out.stdout
    after = {p: p.read_bytes() for p in (tmp_path / "c").rglob("*") if p.is_file()}
    assert after == before  # nothing written, the statistics file included
    assert local_keys(ro) == ["k1", "k2", "k3"]
    dry = kc_json("prune", "--max-entries", "1", "--dry-run", env=ro)  # looking is fine
    assert dry["removed"] == 2


# Item 7: --version, server status|stop, config ------------------------------------------
def test_version() -> None:
    from kernelcache import __version__

    out = kc("--version", env={})
    assert out.returncode == 0
    assert out.stdout.strip() == f"kernelcache {__version__}"


def test_server_status_and_stop(tmp_path: Path) -> None:
    cache_dir = tmp_path / "c"
    env = {"KERNELCACHE_DIR": str(cache_dir)}
    stopped = kc_json("server", "status", env=env)
    assert stopped["running"] is False
    assert stopped["socket"] == str(cache_dir / "launcher.sock")
    start_server(cache_dir, clean_env(cache_dir, KERNELCACHE_SERVER_IDLE="45"))
    try:
        report = kc_json("server", "status", env=env)
        assert report["running"] is True
        assert report["idle_timeout"] == 45.0
        assert report["pid"] == control.running(str(cache_dir))[0]  # type: ignore[index]
        human = kc("server", "status", env=env)
        assert f"yes, pid {report['pid']}" in human.stdout
        assert "45.0 s" in human.stdout
        out = kc("server", "stop", env=env)
        assert out.returncode == 0
        assert f"stopped the launcher server of {cache_dir} (pid {report['pid']})" in out.stdout
        wait_for(lambda: control.running(str(cache_dir)) is None, 30, "the server to exit")
        again = kc("server", "stop", env=env)
        assert "no launcher server runs" in again.stdout
    finally:
        stop_server(cache_dir)


def test_config_lists_every_setting_with_human_sizes(tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(tmp_path), "KERNELCACHE_TRITON_MAX_SIZE": "2G",
           "KERNELCACHE_SERVER_IDLE": "30", "KERNELCACHE_HASH_DIR": "0"}  # fmt: skip
    rows = {r["variable"]: r for r in kc_json("config", env=env)}
    for variable in ("KERNELCACHE_TRITON_DIR", "KERNELCACHE_TRITON_TIMEOUT",
                     "KERNELCACHE_TRITON_NAMESPACE", "KERNELCACHE_BASEDIR",
                     "KERNELCACHE_SLOPPINESS", "KERNELCACHE_NVCC_PREPROCESSED",
                     "KERNELCACHE_SERVER", "KERNELCACHE_SERVER_TIMEOUT",
                     "KERNELCACHE_COMPILED_CLIENT"):  # fmt: skip
        assert variable in rows
    assert rows["KERNELCACHE_TRITON_MAX_SIZE"]["value"] == 2 << 30
    assert rows["KERNELCACHE_SERVER_IDLE"]["value"] == 30.0
    assert rows["KERNELCACHE_HASH_DIR"]["value"] is False
    assert rows["KERNELCACHE_HASH_DIR"]["source"] == "environment KERNELCACHE_HASH_DIR"
    assert rows["KERNELCACHE_TRITON_DIR"]["value"] == str(tmp_path)
    human = kc("config", env=env).stdout
    assert "10.0 GiB" in human  # KERNELCACHE_MAX_SIZE's default
    assert "2.0 GiB" in human
    assert "256.0 MiB" in human


def test_the_launcher_names_an_unusable_directory_once_and_compiles(tmp_path: Path) -> None:
    from launcher_env import Project

    project = Project(tmp_path)
    (tmp_path / "file").write_text("")
    out = project.run(KERNELCACHE_DIR=str(tmp_path / "file" / "kc"))
    assert out.returncode == 0, out.stderr
    assert (project.project / "k.cubin").is_file()
    said = [line for line in out.stderr.decode().splitlines() if line.startswith("kernelcache")]
    assert said == [
        f"kernelcache: cannot set up the cache directory {tmp_path / 'file' / 'kc'} "
        "(Not a directory): nothing is cached there"
    ]


def test_the_launcher_refuses_a_relative_directory_in_one_line_and_compiles(
    tmp_path: Path,
) -> None:
    from launcher_env import Project

    project = Project(tmp_path)
    out = project.run(KERNELCACHE_DIR="rel/kc")
    assert out.returncode == 0, out.stderr
    assert (project.project / "k.cubin").is_file()
    said = [line for line in out.stderr.decode().splitlines() if line.startswith("kernelcache")]
    assert len(said) == 1
    assert "KERNELCACHE_DIR must be an absolute path" in said[0]
    assert not (project.project / "rel").exists()  # no cache made in the working directory
