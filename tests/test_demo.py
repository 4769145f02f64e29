"""The demo times what a build runs and counts what its rows show (issue 20, item 9)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kernelcache import Cache, Entry, Settings, demo


def test_the_nvcc_rows_time_the_kernelcache_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beside = Path(sys.executable).parent / "kernelcache"
    if not os.access(beside, os.X_OK):
        pytest.skip("no kernelcache executable beside this interpreter")
    assert demo.nvcc_front() == ([str(beside)], "kernelcache nvcc")  # not `python -m`
    # Elsewhere, the one on PATH; `python -m kernelcache` (labelled so) only without any.
    bare = tmp_path / "python"
    bare.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(bare))
    monkeypatch.setenv("PATH", str(beside.parent))
    assert demo.nvcc_front() == ([str(beside)], "kernelcache nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert demo.nvcc_front()[1] == "python -m kernelcache"


def test_the_summary_counts_the_disk_hits_of_the_disk_hit_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path))
    settings = Settings.load()
    first = Cache(settings=settings, persist_stats=False)
    first.put("k", Entry({"a": b"x"}))
    assert first.get("k") is not None  # a memory hit
    used = [first]
    for _ in range(3):  # as nvrtc_rows' fresh Caches: a new process's view
        fresh = Cache(settings=settings, persist_stats=False)
        assert fresh.get("k") is not None  # a disk hit
        used.append(fresh)
    demo.print_stats(used)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "hits    3" in lines["disk"]
    assert "hits    1" in lines["memory"]
    for cache in used:
        cache.close()
