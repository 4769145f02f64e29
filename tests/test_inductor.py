"""kernelcache.inductor with real torch.compile on CPU (torch 2.13.0), in child processes.

A "machine" is a process with a local cache directory and a
``TORCHINDUCTOR_CACHE_DIR`` of its own; machines share the suite's Redis.
One team (machine A's compile of an inference and a training graph) is made
once per module and reused; tests that damage the team's entries make their own.
The model compiles to matrix multiplies only (no g++ run: tests/inductor_worker.py)
except where C++ kernels are the point: the trust test (a ``.so`` is code too)
and the race (a compile long enough for the others to arrive during it).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import children  # noqa: E402
import kernelcache.inductor as kci  # noqa: E402
from disk_entries import damage_every_entry  # noqa: E402
from kernelcache.cache import Cache  # noqa: E402
from kernelcache.entry import Entry  # noqa: E402
from kernelcache.inductor import backend  # noqa: E402
from kernelcache.stores.memory import MemoryStore  # noqa: E402
from redis_server import RedisServer, unique_namespace  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "inductor_worker.py"
SECRET = "team-secret-for-tests"
# One graph for inference, two (forward, backward) for training.
GRAPHS = {"infer": 1, "train": 2, "both": 3}
#: The worker's model with a C++ kernel per graph.
MLP = {"KC_TEST_MODEL": "mlp"}


def machine(tmp: Path, name: str, remote: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELCACHE_", "TORCH"))}
    env.update(
        KERNELCACHE_DIR=str(tmp / name / "kc"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / name / "inductor"),
        PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]),
        **extra,
    )
    if remote is not None:
        env["KERNELCACHE_REMOTE"] = remote
    return env


def run(env: dict[str, str], mode: str) -> dict[str, Any]:
    report = children.finish(children.start(WORKER, env, mode))
    assert report["equal"], "compiled outputs and gradients equal eager mode's"
    return report


def misses(report: dict[str, Any]) -> int:
    return int(report["inductor"].get("fxgraph_cache_miss", 0))


def hits(report: dict[str, Any]) -> int:
    return int(report["inductor"].get("fxgraph_cache_hit", 0))


class Team:
    def __init__(self, tmp: Path, server: RedisServer) -> None:
        self.tmp, self.namespace = tmp, unique_namespace()
        self.remote = server.team_url(self.namespace)
        self.artifacts = tmp / "artifacts.bin"
        self.first = run(self.env("a", KC_TEST_SAVE_ARTIFACTS=str(self.artifacts)), "both")

    def env(self, name: str, **extra: str) -> dict[str, str]:
        return machine(self.tmp, name, self.remote, KERNELCACHE_SECRET=SECRET, **extra)


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Team:
    return Team(tmp_path_factory.mktemp("team"), redis_server)


def test_a_second_machine_hits_inference_and_training_graphs(team: Team) -> None:
    assert misses(team.first) == GRAPHS["both"]
    assert team.first["kc"]["puts"] >= GRAPHS["both"]
    # Each compile second is counted once: the inference graph's FX compile ran inside its
    # AOTAutograd compile, whose entry holds both (as a hit there saves both).
    counted = team.first["compile"]["compile_seconds"]
    assert 0 < counted < team.first["stored_seconds"] - 0.01
    # The environment-only way: no install() in the script (KC_TEST_INSTALL=0).
    second = run(team.env("b", KERNELCACHE_INDUCTOR="1", KC_TEST_INSTALL="0"), "both")
    assert misses(second) == 0
    assert hits(second) == GRAPHS["both"]
    assert second["kc"]["hits"] >= GRAPHS["both"]
    # torch loads an AOTAutograd hit's FX graph as a hit of its own, whose compile ran
    # inside the AOTAutograd entry's: the inference hit saved that entry's time, once
    # (the training graphs' AOTAutograd entry is put after its claim ended: no time).
    [inference] = team.first["aot_seconds"]
    assert second["calls"]["infer"]["saved"] == pytest.approx(inference)
    for call in ("infer", "train"):  # and no more than the compile took
        assert 0 < second["calls"][call]["saved"] <= team.first["calls"][call]["wall"], call


def test_a_mega_cache_blob_imported_by_the_cli_prewarms_a_machine(
    team: Team, tmp_path: Path
) -> None:
    env = machine(tmp_path, "image", None)
    cli = [sys.executable, "-m", "kernelcache", "import", "--inductor", str(team.artifacts)]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "inductor" in done.stdout
    report = run(env, "both")
    assert misses(report) == 0
    assert hits(report) == GRAPHS["both"]


def test_force_disable_caches_still_compiles_everything(team: Team) -> None:
    report = run(team.env("c", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1"), "infer")
    assert hits(report) == 0
    assert report["kc"]["hits"] == report["kc"]["misses"] == 0, "kernelcache never asked"


def _flip_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def test_corrupt_disk_entries_are_recompiled(team: Team, tmp_path: Path) -> None:
    local = tmp_path / "m" / "kc"
    shutil.copytree(team.tmp / "a" / "kc", local)
    damaged = damage_every_entry(local, _flip_bytes)
    assert damaged >= GRAPHS["both"]
    report = run(machine(tmp_path, "m", None), "both")  # no team tier: the disk alone
    assert misses(report) == GRAPHS["both"]


def test_corrupt_redis_values_are_recompiled(team: Team, raw: Any) -> None:
    # Damages the team's entries: the last test of this module to use them.
    damaged = 0
    for name in raw.scan_iter(match=f"kc:{team.namespace}:*"):
        value = raw.get(name)
        if isinstance(value, bytes) and len(value) > 256:
            raw.set(name, _flip_bytes(value), keepttl=True)
            damaged += 1
    assert damaged >= GRAPHS["both"]
    report = run(team.env("fresh"), "both")
    assert misses(report) == GRAPHS["both"]


class Payload:
    """Unpickling this writes a marker file: torch's entries are code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def _plant(source: str, target: str, marker: Path) -> int:
    """Put an unsigned entry that runs code in ``target`` under every key that ``source``
    holds (the writer's torch.compile entries: graphs and ``.so`` files)."""
    from kernelcache.stores.redis import RedisStore

    content = pickle.dumps(Payload(str(marker)))
    document = {"data": base64.b64encode(content).decode("ascii"), "time_taken_ms": 1}
    value = Entry({backend.VALUE: json.dumps(document).encode()})
    keys = RedisStore(source)
    store = RedisStore(target)  # no secret: unsigned values
    planted = 0
    for key in list(keys.keys()):
        # An empty namespace: nothing signed to delete first (a keyless client never
        # replaces a signed entry, issue 20; whoever can write to the Redis can delete it).
        store.put(key, value)
        planted += 1
    keys.close()
    store.close()
    return planted


@pytest.mark.slow
def test_an_unsigned_team_entry_is_never_unpickled(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    written, refused, trusted = (redis_server.team_url(unique_namespace()) for _ in range(3))
    trusting = {"KERNELCACHE_INDUCTOR_TRUST_UNSIGNED": "1", **MLP}
    # Two compile threads, whatever the cores: the graph's C++ kernel is built on the pool.
    writer = run(
        machine(tmp_path, "writer", written, TORCHINDUCTOR_COMPILE_THREADS="2", **trusting),
        "infer",
    )
    assert writer["cpp"]["compiles"] >= 2, "the ISA probe's and the kernel's .so are entries"
    # Each build counted inside the graph's compile, the pool's too: a hit on the graph
    # saves their time, and theirs do not count it again.
    assert writer["builds"] >= 2
    assert writer["unnested_builds"] == 0
    marker, control = tmp_path / "unpickled", tmp_path / "unpickled-where-trusted"
    entries = GRAPHS["infer"] + writer["cpp"]["compiles"]
    assert _plant(written, refused, marker) >= entries
    assert _plant(written, trusted, control) >= entries

    # All three at once, each on its own copy of the planted entries.
    keyless = children.start(WORKER, machine(tmp_path, "keyless", refused, **MLP), "infer")
    signed = children.start(
        WORKER, machine(tmp_path, "signed", refused, KERNELCACHE_SECRET=SECRET, **MLP), "infer"
    )
    # The test can fail: a machine that opts in to unsigned entries runs the payload.
    opted_in = children.start(WORKER, machine(tmp_path, "trusting", trusted, **trusting), "infer")
    for report in (children.finish(keyless), children.finish(signed)):
        assert report["equal"]
        assert misses(report) == GRAPHS["infer"], "compiled: the planted entry was not used"
        assert report["cpp"]["hits"] == 0, "built: no planted .so was used"
        assert report["cpp"]["compiles"] == writer["cpp"]["compiles"]
    opted_in.communicate(timeout=600)
    assert not marker.exists()
    assert control.exists()


@pytest.mark.slow
def test_four_processes_released_together_compile_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    remote = redis_server.team_url(unique_namespace())
    go = tmp_path / "go"
    procs = [
        children.start(
            WORKER,
            machine(tmp_path, f"m{i}", remote, KERNELCACHE_SECRET=SECRET, **MLP),
            "infer",
            str(go),
        )
        for i in range(4)
    ]
    children.release(go, procs)
    reports = [children.finish(p) for p in procs]
    assert all(r["equal"] for r in reports)
    assert sum(misses(r) for r in reports) == GRAPHS["infer"]
    assert sum(r["kc"]["waits"] + r["kc"]["hits"] for r in reports) >= 3


# In process: the seams and the trust rule, no compile ----------------------------------
def _torch_state() -> dict[str, Any]:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import remote_cache

    state: dict[str, Any] = {
        name: vars(getattr(remote_cache, name)).get("backend_override_cls", "absent")
        for name in kci.OVERRIDDEN
    }
    for module, names in (
        (inductor_config, ("fx_graph_remote_cache", "autotune_remote_cache")),
        (functorch_config, ("enable_remote_autograd_cache",)),
    ):
        for name in names:
            state[name] = (getattr(module, name), module._is_default(name))  # noqa: SLF001
    state["inductor"] = inductor_config.get_config_copy()
    state["functorch"] = functorch_config.get_config_copy()
    return state


def test_uninstall_restores_torch_exactly() -> None:
    from torch._inductor import config as inductor_config
    from torch._inductor import remote_cache

    before = _torch_state()
    with kci.enabled(Cache([MemoryStore()], persist_stats=False)):
        assert inductor_config.fx_graph_remote_cache is True
        assert remote_cache.RemoteFxGraphCache.backend_override_cls is not None
        assert _torch_state() != before
    assert _torch_state() == before


def test_a_switch_the_user_set_is_left_alone() -> None:
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_remote_cache=False):
        with kci.enabled(Cache([MemoryStore()], persist_stats=False)):
            assert inductor_config.fx_graph_remote_cache is False
        assert inductor_config.fx_graph_remote_cache is False


def test_fx_graph_cache_off_keeps_the_remote_one_off() -> None:
    from torch._inductor import config as inductor_config

    off = inductor_config.patch(fx_graph_cache=False)
    with off, kci.enabled(Cache([MemoryStore()], persist_stats=False)):
        assert inductor_config.fx_graph_remote_cache is None


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
    secret: str | None, trust: bool | None, read: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from torch._inductor.remote_cache import RemoteFxGraphCache

    team = _TeamTier(secret)
    value = Entry({backend.VALUE: b'{"data": "", "time_taken_ms": 1}'})
    team.put(backend.entry_key("pt2:fx-graph-v1::k:c1"), value)
    cache = Cache([MemoryStore(), team], persist_stats=False)
    with (
        caplog.at_level(logging.WARNING, "kernelcache.inductor"),
        kci.enabled(cache, trust_unsigned=trust),
    ):
        found = RemoteFxGraphCache("fx-graph-v1").get("k")
    assert (found is not None) is read
    warned = [r for r in caplog.records if "KERNELCACHE_SECRET" in r.getMessage()]
    assert len(warned) == (0 if read else 1)
    assert "\n" not in (warned[0].getMessage() if warned else "")


def test_each_torch_release_and_build_keys_its_own_entries() -> None:
    key = "pt2:autotune-best-config-v2::k:c1"  # an autotune key holds no torch version
    keys = {backend.entry_key(key, v) for v in ("2.10.0", "2.15.0", "2.15.0+cpu", "2.15.0+cu132")}
    assert len(keys) == 4
    assert backend.entry_key(key) == backend.entry_key(key, str(torch.__version__))


def _service(cache: Cache) -> backend.Service:
    counts: dict[str, int] = {}

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    return backend.Service(lambda: cache, count, lambda: 60.0)


def test_a_miss_claims_until_the_put_and_a_repeat_miss_does_not_wait_on_itself() -> None:
    cache = Cache([MemoryStore()], persist_stats=False)
    service = _service(cache)
    try:
        assert service.get("pt2:fx-graph-v1::k:c1") is None
        # torch could not pickle the graph, never put, and asks again: no 60 s wait on itself.
        assert service.get("pt2:fx-graph-v1::k:c1") is None
        service.put("pt2:fx-graph-v1::k:c1", b"graph")
        assert service.get("pt2:fx-graph-v1::k:c1") == b"graph"
        assert cache.get(backend.entry_key("pt2:fx-graph-v1::k:c1")) is not None
    finally:
        service.close()


@pytest.mark.parametrize("how", ["end_compile", "expire", "abandon_all"])
def test_a_claim_without_a_put_is_given_up(how: str) -> None:
    service = _service(Cache([MemoryStore()], persist_stats=False))
    try:
        assert service.get("pt2:autograd-experimental::k:c1") is None
        flights = service.flights
        dropped = flights.expire(0.0) if how == "expire" else getattr(flights, how)()
        assert dropped == 1
        assert flights.abandon_all() == 0
    finally:
        service.close()
