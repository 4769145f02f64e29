"""kernelcache on a network filesystem, per fault mode (issue 22), on two FUSE "nodes".

Four processes on each node share keys in one disk tier whose cap forces
eviction (tests/netfs_stress.py). In every mode: no wrong bytes, no exception
reaches the caller, no process hangs, ``kernelcache verify`` is clean. Where
the faults are not random: the tier within its cap and holding most of it,
and one compile per key across both nodes (under attribute caching too: a
node's cached name, absent or another leader's probe file, must not hide the
other node's entry; the deterministic cases: tests/test_netfs_lookup.py). The
same figures for the issue's sizes, and for Triton's and diskcache's caches:
benchmarks/bench_netfs.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import netfs_stress as st
import netfs_worker as worker
from netfs import NO_FAULTS, NetFS

# Fewer keys and calls than the benchmark (50 keys, 256 KiB): 12 keys of 4-11 KiB
# (about 90 KiB) under a 40 KiB cap still evict on every few puts.
KEYS, OPS, CAP = 12, 20, 40 * 1024
#: Bytes over the cap that a tier may hold (eviction runs after the put that crosses it).
SLACK = 16 * 1024
#: Not here: latency (the benchmark's hit costs) and coherent. On a network filesystem
#: the disk tier takes leases, never flock, so coherent (flock spans the nodes) and
#: flock-local differ only in the statistics file's lock, which no assertion here
#: looks at; the faulty one of the two stays. The benchmark runs every mode.
TEST_MODES = [m for m in st.MODES if m.name not in ("latency", "coherent")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param(m, id=m.name) for m in TEST_MODES])
def test_kernelcache_holds_on_a_network_filesystem(
    two_nodes: Callable[..., NetFS], mode: st.Mode
) -> None:
    fs = two_nodes(mode.flock, mode.faults)
    result = st.stress(
        fs, "kernelcache", "cache", procs=4, ops=OPS, keys=KEYS, cap=CAP, timeout=120
    )
    for node in fs.nodes:
        node.set(NO_FAULTS)
    status, damaged = st.verify(fs.nodes[0].path / "cache")
    stored = st.stored_bytes(fs.backing / "cache" / "v1" / "entries")
    figures = (
        f"{mode.name}: wrong={result.wrong} escaped={result.escaped} hung={result.hung} "
        f"compiles/key max={result.max_per_key} mean={result.mean_per_key:.2f} stored={stored}"
    )
    assert result.hung == 0, figures
    assert result.escaped == {}, figures
    assert result.wrong == 0, figures
    assert result.calls == 8 * (KEYS + OPS), figures
    assert (status, damaged) == (0, []), figures
    if not mode.random:
        assert CAP // 2 <= stored <= CAP + SLACK, figures
    if not mode.random:
        assert result.max_per_key == 1, figures


def test_a_worker_whose_cache_fails_to_open_still_releases_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its peers wait at the stampede barrier for every process: one that cannot open its
    cache (diskcache's SQLite file, corrupted by the other node) must pass it too, or they
    wait out the barrier's 120 s (the benchmark's smoke run took 2 minutes so)."""

    def refuse(path: str, cap: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setitem(worker.KINDS, "refusing", refuse)
    through: list[int] = []
    report = worker.run("refusing", "unused", 1, 1, 0, 0, 0.0, lambda: through.append(1))
    assert through == [1]
    assert report["escaped"] == {"OSError: Input/output error": 1}


def test_a_worker_that_dies_does_not_hold_the_others_at_the_barrier(
    two_nodes: Callable[..., NetFS],
) -> None:
    """A diskcache worker dies of SIGBUS when the other node truncates the SQLite file it
    maps (3 of ~250 smoke runs under load; its peer then sat 2 min at the barrier).
    The one that dies here is counted; the others finish well before their timeout."""
    fs = two_nodes("local")
    result = st.stress(fs, "crashing-once", "cache", procs=2, ops=2, keys=4, timeout=60)
    assert result.hung == 0
    assert result.escaped == {"exit -7: []": 1}
    assert result.calls == 3 * (4 + 2)
