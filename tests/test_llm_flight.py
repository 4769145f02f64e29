"""The launcher server's flight claims (:class:`kernelcache.nvcc.flight.Flying`), with real locks.

The end-to-end behaviour (eight ranks, one nvcc run) is in test_llm_launcher.py;
here, each rule of the claims the server holds for its clients: one per command,
none while another process holds the command's lock, given up when the client
stores, dies or runs past the limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache.cache import Cache
from kernelcache.nvcc import flight
from kernelcache.settings import Settings

HOLDER = """
import sys
from kernelcache.cache import Cache
from kernelcache.settings import Settings
cache = Cache(settings=Settings.load(dir=sys.argv[1], remote=""))
claim = cache.claim(sys.argv[2], timeout=0)
print("held" if claim.leads and not claim.contended else "not held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    with Cache(settings=Settings.load(dir=str(tmp_path / "c"), remote="")) as opened:
        yield opened


def dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_one_claim_per_command_until_its_client_stores(cache: Cache) -> None:
    flying = flight.Flying()
    assert flying.take(cache, "a" * 64, pid=1)  # pid 1 is alive
    assert not flying.take(cache, "a" * 64, pid=os.getpid())  # the same command: busy
    assert flying.take(cache, "a" * 64, pid=1)  # its own client asking again: still its
    assert flying.take(cache, "b" * 64, pid=1)  # another command
    assert len(flying) == 2
    flying.land("a" * 64, pid=2)  # another client's store does not end it
    assert len(flying) == 2
    flying.land("a" * 64, pid=1)
    assert len(flying) == 1
    assert flying.take(cache, "a" * 64, pid=1)
    flying.close()
    assert len(flying) == 0


def test_a_dead_or_late_client_loses_its_claim(cache: Cache) -> None:
    flying = flight.Flying()
    assert flying.take(cache, "c" * 64, pid=dead_pid())
    assert flying.take(cache, "c" * 64, pid=1)  # the sweep gave the dead one's up
    flying.sweep(limit=-1.0)  # past the limit
    assert len(flying) == 0


def test_a_command_another_process_compiles_is_not_claimed(tmp_path: Path, cache: Cache) -> None:
    key = flight.flight_key("d" * 64)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "c"), key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        flying = flight.Flying()
        assert not flying.take(cache, "d" * 64, pid=1)
        assert len(flying) == 0
    finally:
        holder.communicate("")
    assert flying.take(cache, "d" * 64, pid=1)  # its lock died with it
    flying.close()


@pytest.mark.parametrize(("value", "expected"), [(None, flight.TIMEOUT), ("0", 0.0), ("2.5", 2.5)])
def test_flight_timeout(value: str | None, expected: float) -> None:
    env = {} if value is None else {"KERNELCACHE_NVCC_FLIGHT_TIMEOUT": value}
    assert flight.timeout(env) == expected


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_flight_timeout_is_said(value: str) -> None:
    with pytest.raises(ValueError, match="KERNELCACHE_NVCC_FLIGHT_TIMEOUT must be seconds"):
        flight.timeout({"KERNELCACHE_NVCC_FLIGHT_TIMEOUT": value})


def test_kernelcache_config_shows_the_flight_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kernelcache.cli.main import main as cli

    monkeypatch.setenv("KERNELCACHE_NVCC_FLIGHT_TIMEOUT", "later")
    assert cli(["config", "--json", "--dir", str(tmp_path / "c")]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["nvcc_flight_timeout"]["value"].startswith("invalid: ")
    assert rows["vllm"]["value"] is False
