"""torch.compile's C++ builds on CPU through kernelcache: a second machine runs no g++ at all.

Real torch.compile (torch 2.13 CPU) and real g++, behind a wrapper that logs
every command line; each "machine" is a child process with its own
TORCHINDUCTOR_CACHE_DIR and temporary directory (torch's precompiled headers),
each with a local disk tier of its own, sharing one team tier (a real
redis-server). The second machine and the third (whose team tier is a damaged
copy of the first machine's disk tier) run at the same time; a fourth runs
after a header the kernel reads changed (an ``omp.h`` in a ``CPATH`` folder,
in front of g++'s own).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from children import finish, start
from disk_entries import damage_every_entry
from kernelcache.stores.disk import DiskStore
from redis_server import RedisServer

CHILD = Path(__file__).with_name("inductor_cpp_child.py")
ROOT = Path(__file__).resolve().parent.parent
PATHS = (str(ROOT / "src"), str(ROOT / "tests"))
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++")

# The same script on every machine (its content is in the compiler's identity):
# the log's path comes from the environment.
WRAPPER = """#!/bin/sh
printf '%s\\n' "$*" >> "$KC_TEST_GXX_LOG"
exec {gxx} "$@"
"""


#: The g++ runs torch makes itself, with or without a cache (cpp_builder: _is_gcc,
#: get_compiler_version_info, ...): the wrapper logs their arguments alone.
TORCH_PROBES = ("--version", "-v")


class Machine:
    """A child process compiling with its own cache directories; g++ runs are logged."""

    def __init__(self, tmp: Path, name: str, team: str, wrapper: Path, cpath: Path) -> None:
        home = tmp / name
        (home / "tmp").mkdir(parents=True)
        self.log = home / "g++.log"
        env = {
            **os.environ,
            # An inherited PYTHONPATH first: checking this test against another tree works.
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *PATHS) if p),
            "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
            "TMPDIR": str(home / "tmp"),
            "KERNELCACHE_DIR": str(home / "kc-local"),  # the toolchain memo: per machine
            "CXX": str(wrapper),
            "KC_TEST_GXX_LOG": str(self.log),
            "CPATH": str(cpath),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
        self.local = home / "kc-disk"
        self.proc = start(CHILD, env, team, str(self.local))

    def finish(self) -> tuple[dict[str, Any], list[str]]:
        report = finish(self.proc)
        commands = self.log.read_text().splitlines() if self.log.exists() else []
        return report, commands


def _builds(commands: list[str]) -> list[str]:
    """The compiler runs that produce a binary: kernels, ISA probes, precompiled headers
    (not the preprocessor runs that key the headers, nor version probes)."""
    binary = (" -shared", " -c ", "c++-header")
    return [c for c in commands if " -E " not in c and any(b in c for b in binary)]


def _corrupt_entries(shared: Path, kind: str) -> int:
    store = DiskStore(str(shared))
    chosen = set()
    for key in list(store.keys()):
        entry = store.get(key)
        if entry is not None and entry.meta.get("kind") == kind:
            chosen.add(key)
    store.close()

    def flip(data: bytes) -> bytes:  # inside the .so's bytes, past the header
        return data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]

    return damage_every_entry(shared, flip, chosen)


@pytest.mark.slow
def test_second_machine_builds_nothing_and_corrupt_kernels_are_rebuilt(
    tmp_path: Path, redis_server: RedisServer, ns: str
) -> None:
    assert GXX is not None
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(gxx=GXX))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    team = redis_server.team_url(ns)
    cpath = tmp_path / "include"
    cpath.mkdir()
    (cpath / "omp.h").write_text("#include_next <omp.h>\n")

    def machine(name: str, tier: str) -> Machine:
        return Machine(tmp_path, name, tier, wrapper, cpath)

    one = machine("one", team)
    first, first_cmds = one.finish()
    assert first["equal"]
    assert first["stats"]["compiles"] >= 2  # the ISA probe and the kernel, at least
    assert len(_builds(first_cmds)) >= first["stats"]["compiles"]

    damaged = tmp_path / "team-damaged"
    shutil.copytree(one.local, damaged)
    assert _corrupt_entries(damaged, "so") >= 2
    two = machine("two", team)
    three = machine("three", str(damaged))

    second, second_cmds = two.finish()
    assert second["equal"]
    assert second["stats"]["compiles"] == 0
    assert second["stats"]["hits"] == first["stats"]["compiles"]
    # Through the manifests: no header scan, no -march=native probe, no g++ run but
    # torch's own probes (its command lines and graph keys name the compiler's version).
    assert [c for c in second_cmds if c not in TORCH_PROBES] == [], "a second machine ran g++"
    assert second["stats"]["direct_hits"] == first["stats"]["compiles"]
    assert second["stats"]["header_scans"] == 0
    assert (first["stats"]["pch_built"], second["stats"]["pch_built"]) == (1, 0)
    assert _builds(second_cmds) == [], "a second machine ran a C++ build"
    assert not list((tmp_path / "two" / "tmp").rglob("*.gch")), "the PCH was not needed"

    third, third_cmds = three.finish()
    assert third["equal"]
    # Every .so was rebuilt (the stored ones failed their check), so the PCH was needed.
    assert third["stats"]["compiles"] == first["stats"]["compiles"]
    assert third["stats"]["pch_built"] == 1
    assert len([c for c in _builds(third_cmds) if " -shared" in c]) == first["stats"]["compiles"]

    # A header the kernel reads changed: its manifest variant fails, the scan runs, and
    # the kernel is compiled again (the stored .so was built against the old header).
    (cpath / "omp.h").write_text("#include_next <omp.h>\n#define KC_TEST_CHANGED 1\n")
    fourth, fourth_cmds = machine("four", team).finish()
    assert fourth["equal"]
    assert fourth["stats"]["header_scans"] >= 1
    assert fourth["stats"]["compiles"] >= 1
    assert (
        fourth["stats"]["direct_hits"] == first["stats"]["compiles"] - fourth["stats"]["compiles"]
    )
    assert [c for c in _builds(fourth_cmds) if " -shared" in c]
