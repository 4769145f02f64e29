"""The shared-filesystem stress: fault modes, and N processes per node against one cache.

Used by tests/test_netfs_modes.py (few keys and calls) and benchmarks/bench_netfs.py
(the issue's 50 keys, 256 KiB cap). Each process runs tests/netfs_worker.py; the
figures are summed over both nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import children
from netfs import Faults, NetFS

WORKER = Path(__file__).resolve().parent / "netfs_worker.py"
_ERROR_OPS = ("lookup", "getattr", "open", "create", "read", "write", "rename", "unlink", "mkdir", "rmdir", "fsync", "readdir", "flock")  # fmt: skip
_REMOVALS = ("rename", "unlink", "rmdir")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way a network filesystem misbehaves: the lock behaviour and both mounts' faults."""

    name: str
    flock: str
    faults: Faults
    about: str
    #: Random faults: a process that meets one may compile on its own (liveness
    #: beats deduplication), so one compile per key is a target, not a promise.
    random: bool = False


MODES = (
    Mode("coherent", "shared", Faults(), "no faults; flock spans nodes (NFSv4 with working locks)"),
    Mode("flock-local", "local", Faults(), "flock never conflicts across nodes (FUSE stores, NFS local_lock)"),
    Mode("flock-none", "none", Faults(), "every flock fails with ENOLCK (Lustre without -o flock)"),
    Mode("estale", "shared", Faults(stale_unlinked=True), "ESTALE on a file the other node removed or replaced (NFSv3)"),
    Mode("estale-random", "shared", Faults(stale_unlinked=True, estale_ppm=5000, estale_ops=_ERROR_OPS),
         "plus 0.5 % of requests fail with ESTALE", random=True),
    Mode("eio", "shared", Faults(eio_ppm=5000, eio_ops=_ERROR_OPS), "0.5 % of requests fail with EIO", random=True),
    Mode("ebusy", "shared", Faults(ebusy_open=True, ebusy_ppm=20000, ebusy_ops=_REMOVALS),
         "EBUSY on rename/unlink/rmdir of open files, and 2 % of the others (GPFS)", random=True),
    Mode("attr-lag", "shared", Faults(attr_timeout_ms=1000), "attributes and names cached for 1 s (NFS actimeo)"),
    Mode("latency", "shared", Faults(latency_us=2000), "2 ms per request"),
)  # fmt: skip
BY_NAME = {m.name: m for m in MODES}


@dataclasses.dataclass
class Result:
    """What the processes of one run saw, summed over both nodes."""

    calls: int = 0
    wrong: int = 0
    escaped: dict[str, int] = dataclasses.field(default_factory=dict)
    hung: int = 0
    #: Compiles per key during the stampede (every process asks for every key once, in one order).
    stampede: dict[str, int] = dataclasses.field(default_factory=dict)
    compiles: int = 0
    seconds: float = 0.0
    #: Each process's stampede compiles (how many keys it compiled), in start order.
    per_process: list[int] = dataclasses.field(default_factory=list)
    #: The longest any call took, less its own compile (seconds): a wait on others.
    slowest: float = 0.0
    #: The disk tier's counters summed over the processes (kernelcache only).
    counters: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def escaped_total(self) -> int:
        return sum(self.escaped.values())

    @property
    def max_per_key(self) -> int:
        return max(self.stampede.values(), default=0)

    @property
    def mean_per_key(self) -> float:
        return sum(self.stampede.values()) / max(1, len(self.stampede))

    def add(self, report: dict[str, Any]) -> None:
        self.calls += report["calls"]
        self.wrong += report["wrong"]
        for what, n in report["escaped"].items():
            self.escaped[what] = self.escaped.get(what, 0) + n
        for key, n in report["stampede"].items():
            self.stampede[key] = self.stampede.get(key, 0) + n
        self.compiles += sum(report["compiles"].values())
        self.per_process.append(sum(report["stampede"].values()))
        self.slowest = max(self.slowest, report.get("slowest", 0.0))
        for name, n in report.get("counters", {}).items():
            self.counters[name] = self.counters.get(name, 0) + n


def stress(
    fs: NetFS,
    kind: str,
    sub: str,
    *,
    procs: int = 4,
    ops: int = 40,
    keys: int = 20,
    cap: int = 64 * 1024,
    compile_ms: float = 20.0,
    timeout: float = 180.0,
) -> Result:
    """``procs`` processes on each node use cache ``kind`` in ``<node>/sub``; their summed figures.

    A process still running after ``timeout`` seconds is killed and counted as hung.
    """
    go = str(fs.root / f"go-{sub}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    started = []
    for n in range(2 * procs):
        node = fs.nodes[n % 2]
        args = (
            kind,
            str(node.path / sub),
            str(ops),
            str(keys),
            str(cap),
            str(n),
            go,
            str(compile_ms),
            str(2 * procs),
        )
        started.append(children.start(WORKER, env, *args))
    _release(go, len(started))
    began = time.monotonic()
    _through_when_gone(started, f"{go}.stampede", began + timeout)
    result = Result()
    for proc in started:
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            result.hung += 1
            continue
        if proc.returncode != 0:  # a crash (SIGBUS, an exception at exit) also reached the caller
            result.escaped[f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}"] = 1
            continue
        result.add(json.loads(out.strip().splitlines()[-1]))
    result.seconds = time.monotonic() - began
    return result


def _through_when_gone(procs: list[subprocess.Popen[str]], stem: str, deadline: float) -> None:
    """Wait for ``procs`` to end (or ``deadline``), marking each that ends as through the
    stampede's barrier (netfs_worker.barrier): one that died on the way (diskcache's
    worker meets SIGBUS when the other node truncates the SQLite file it maps) must not
    keep the others waiting out the barrier (the benchmark's smoke run took 2 min so)."""
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        for proc in [p for p in pending if p.poll() is not None]:
            with open(f"{stem}.{proc.pid}", "a"):
                pass
            pending.remove(proc)
        time.sleep(0.01)


def _release(go: str, count: int) -> None:
    """Start the children at once: wait until all are ready, then create ``go``."""
    folder, stem = os.path.split(go)
    deadline = time.monotonic() + 120
    while sum(name.startswith(f"{stem}.ready.") for name in os.listdir(folder)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("netfs workers did not start")
        time.sleep(0.02)
    with open(go, "w"):
        pass


def verify(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """``kernelcache verify --json`` on ``path``: (exit status, damaged entries)."""
    cli = Path(sys.executable).parent / "kernelcache"
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "kernelcache"]
    proc = subprocess.run(
        [*cmd, "verify", "--dir", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        bad = list(json.loads(proc.stdout)["bad"])
    except (ValueError, KeyError):
        bad = [{"error": f"no report: {proc.stderr[-2000:]}"}]
    return proc.returncode, bad


def staging_left(backing: Path, sub: str) -> list[str]:
    """Items left in the disk tier's staging folder (half-done puts and removals)."""
    staging = backing / sub / "v1" / "staging"
    return sorted(os.listdir(staging)) if staging.is_dir() else []


def stored_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (the backing directory: no faults, no lag)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
