"""The store and Redis benchmarks still run end to end (a few calls each; no timing is asserted)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_stores.py"


def test_bench_stores_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--dir", str(tmp_path), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| target (shared/DESIGN.md) | measured | verdict |" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_stores"
    assert doc["command"].startswith("python benchmarks/bench_stores.py --smoke")
    assert "kernelcache DiskStore" in doc["contenders"]
    result = doc["details"]
    measured = {(r["op"], r["size"], r["name"]) for r in result["rows"] if r.get("n")}
    for size in (4096, 65536, 1 << 20):
        for op in ("get", "put"):
            # The raw limit and kernelcache's own tiers always run; peers may be n/a.
            for tier in ("MemoryStore", "DiskStore", "SQLiteStore"):
                assert (op, size, f"kernelcache {tier}") in measured
        assert ("get", size, "raw file (open().read() / tmp+rename)") in measured
    assert {r["op"] for r in result["scaling"]} == {"get", "put"}
    assert result["memory"][0]["n"] > 0
    caps = result["caps"]["rows"]
    assert {r["extract"] for r in caps} == {False, True}
    assert max(r["size"] for r in caps) > 0
    assert {t["verdict"] for t in doc["targets"]} <= {"PASS", "MISS", "n/a", "info"}
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("kernelcache-bench-")]
    assert leftovers == [], "the benchmark must remove its directory"


def test_small_designs_smoke(tmp_path: Path) -> None:
    """The design comparison of issue 40 runs end to end: every design hits every key."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = ROOT / "benchmarks" / "small_designs.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--keys", "20", "--passes", "1", "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "µs" in line]
    assert len(rows) == 6  # DiskStore as shipped (packed) and with a file per entry
    assert list(tmp_path.iterdir()) == [], "the benchmark must remove its directory"


def test_bench_redis_smoke(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed (scripts/test.sh installs them)")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_redis.py"),
            "--smoke",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    hits = doc["details"]["hits"]
    assert len(doc["targets"]) == len(hits)
    measured = {(r["target"], r["size"], r["variant"]) for r in hits}
    for target in ("server", "cluster"):
        for size in (4096, 65536, 1 << 20):
            assert {(target, size, "plain"), (target, size, "signed")} <= measured
    assert {r["verdict"] for r in hits} <= {"PASS", "MISS"}


def test_bench_launcher_smoke(tmp_path: Path) -> None:
    """bench_launcher.py runs end to end on a few calls (the peers only where installed)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    script = ROOT / "benchmarks" / "bench_launcher.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--repeat", "2", "--headers", "10", "--files", "0"],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("python -I -S -c pass") == 2
    assert "kernelcache" in proc.stdout
    assert "timed runs were hits" not in proc.stdout
    assert "Edit one .cu file and rebuild it" in proc.stdout
    assert re.search(r"^kernelcache +[\d.]+ +[\d.]+ +[\d.]+x$", proc.stdout, re.MULTILINE)


@pytest.mark.slow
def test_bench_netfs_smoke(tmp_path: Path) -> None:
    import netfs

    reason = netfs.unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_netfs.py"),
            "--smoke",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| target | verdict |" in proc.stdout
    doc = json.loads(out.read_text())
    assert all(t["measured"] for t in doc["targets"])
    result = doc["details"]
    assert {r["cache"] for r in result["stress"]} >= {"kernelcache"}
    ours = [r for r in result["cost"] if r["cache"] == "kernelcache"]
    assert [r["attr_ms"] for r in ours] == [0]
    assert all(r["hit_round_trips"] > 0 for r in ours)  # the mount counted the hit's requests


def test_bench_dsl_states_each_issue_23_target_with_a_verdict() -> None:
    """The verdict table of bench_dsl.py (no compile: rows as its runs report them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_dsl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    base = {"dsl": "tilelang", "kernel": "add"}
    cold = [
        {**base, "cache": "upstream", "cold_s": 1.0, "cold_cpu_s": 1.0, "warm_s": 0.010,
         "warm_cpu_s": 0.010, "used_s": 1.0, "used_cpu_s": 1.0},
        {**base, "cache": "kernelcache", "cold_s": 1.04, "cold_cpu_s": 1.1, "warm_s": 0.009,
         "warm_cpu_s": 0.02, "used_s": 1.2, "used_cpu_s": 1.0, "warm_import_s": 0.002},
    ]  # fmt: skip
    many = [
        {**base, "cache": "upstream", "procs": 2, "nvcc": 2, "wall_s": 2.0},
        {**base, "cache": "kernelcache", "procs": 2, "nvcc": 1, "wall_s": 1.5},
    ]
    sweeps = [
        {**base, "cache": "upstream", "procs": 2, "kernels": 3, "wall_s": 10.0},
        {**base, "cache": "kernelcache", "procs": 2, "kernels": 3, "wall_s": 10.6},
    ]
    rows = bench_dsl.targets(cold, many, sweeps)
    verdicts = {row["target"].split(": ", 1)[1]: row for row in rows}
    assert {k: v["verdict"] for k, v in verdicts.items()} == {
        "cold, first run": "PASS",
        "cold, cache in use": "MISS",
        "hit, fresh process": "PASS",
        "hit, fresh process, kernelcache's import included": "MISS",
        "2 processes at once, wall (1 nvcc vs 2)": "PASS",
        "sweep, 2 processes x 3 new kernels, wall": "MISS",  # 1.06x
    }
    with_import = verdicts["hit, fresh process, kernelcache's import included"]
    assert with_import["kernelcache"] == pytest.approx(0.011)  # the hit plus the import
    assert verdicts["cold, first run"]["cpu ratio"] == "1.10"


def test_bench_compilers_compares_an_nvrtc_cold_compile_withnvrtc_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23's cold rule for NVRTC: both sides compile the same thing, and each kernel
    gets a verdict (one run each; no timing is asserted)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "kc"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_compilers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from kernelcache import Cache, nvrtc
    from kernelcache.stores.memory import MemoryStore

    source = (bench_compilers.EXAMPLES / "saxpy.cu").read_text() + "\n// the same work\n"
    alone = bench_compilers.nvrtc_alone(source, "saxpy.cu", "sm_90", str(bench_compilers.EXAMPLES))
    ours = nvrtc.compile(
        source, name="saxpy.cu", arch="sm_90", include_dirs=[str(bench_compilers.EXAMPLES)],
        cache=Cache([MemoryStore()]),
    )  # fmt: skip
    assert alone == ours.binary  # the same compile on both sides
    bench_compilers.bench_nvrtc_cold("sm_90", 1)
    lines = capsys.readouterr().out.splitlines()
    verdicts = [line for line in lines if "x NVRTC alone (target <= 1.05x)" in line]
    assert [v.split()[3] for v in verdicts] == [f"{k}:" for k in bench_compilers.KERNELS]
    assert all(v.split()[0] in ("PASS", "MISS") for v in verdicts)
