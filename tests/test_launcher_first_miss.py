"""A first miss into an empty cache directory starts nvcc before the launcher's server (issue 40).

A fresh CI runner's first build finds no server: each call compiles in its own
process, and only later calls use a server. So the first miss must not pay for
the server's start before its compile: it starts it while nvcc works. Shown by
order, not by time: the in-process launcher runs a real nvcc and starts a real
server, and the test notes which of the two began first.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kernelcache.nvcc import launcher, spawn
from launcher_env import CUBIN, KERNEL, clean_env, listening, stop_server, wait_for

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def test_a_first_miss_runs_nvcc_before_it_starts_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "k.cu").write_text(KERNEL)
    cache = tmp_path / "cache"  # empty: no server, nothing stored
    for name, value in clean_env(cache).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(project)
    events: list[str] = []
    real_popen, real_wake = subprocess.Popen, spawn.wake

    class Noted(real_popen):  # type: ignore[misc,valid-type]
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            words = [str(a) for a in args] if isinstance(args, list) else [str(args)]
            if "-cubin" in words and "--dryrun" not in words:
                events.append("nvcc")  # the compile itself, not a probe
            super().__init__(args, *rest, **kwargs)

    def wake(directory: str, environ: Any) -> bool:
        events.append("server")
        return real_wake(directory, environ)

    monkeypatch.setattr(subprocess, "Popen", Noted)
    monkeypatch.setattr(spawn, "wake", wake)
    try:
        assert launcher.main(["nvcc", *CUBIN]) == 0
        assert (project / "k.cubin").stat().st_size > 0
        assert events == ["nvcc", "server"]
        # ... and the server it started listens, for the next call.
        wait_for(lambda: listening(cache), 60, "the server the first miss started")
    finally:
        monkeypatch.undo()
        stop_server(cache)
