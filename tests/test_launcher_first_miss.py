"""A first miss into an empty cache directory starts nvcc before the launcher's server (issue 40).

A fresh CI runner's first build finds no server: each call compiles in its own
process, and only later calls use a server. So the first miss must not pay for
the server's start before its compile: it starts it while nvcc works. Shown by
order, not by time: the compiler (a real nvcc behind a small wrapper named
``nvcc``) notes whether a server start had begun when it was run to compile.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from launcher_env import KERNEL, clean_env, listening, make_bin, stop_server, wait_for

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

#: The compiler: real nvcc, noting (for a compile, not a --version or --dryrun probe)
#: whether the server's start marker or socket existed when it was run.
WRAPPER = """#!/bin/sh
case " $* " in
*" --version "* | *" --dryrun "*) ;;
*)
    if [ -e "$KERNELCACHE_DIR/launcher.starting" ] || [ -e "$KERNELCACHE_DIR/launcher.sock" ]; then
        echo server-started >>"$NOTES"
    else
        echo no-server-yet >>"$NOTES"
    fi
    ;;
esac
exec {nvcc} "$@"
"""


def test_a_first_miss_runs_nvcc_before_it_starts_the_server(tmp_path: Path) -> None:
    front = make_bin(tmp_path / "bin")
    tools = tmp_path / "tools"
    tools.mkdir()
    nvcc = tools / "nvcc"
    nvcc.write_text(WRAPPER.format(nvcc=shutil.which("nvcc")))
    nvcc.chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    (project / "k.cu").write_text(KERNEL)
    cache = tmp_path / "cache"  # empty: no server, nothing stored
    notes = tmp_path / "notes"
    env = clean_env(cache, NOTES=str(notes))
    try:
        proc = subprocess.run(
            [str(front), str(nvcc), "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"],
            cwd=project,
            env=env,
            capture_output=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert (project / "k.cubin").stat().st_size > 0
        assert notes.read_text().split() == ["no-server-yet"]  # one compile, no server begun
        # ... and the server was started all the same, for the next call.
        wait_for(lambda: listening(cache), 60, "the server the first miss started")
    finally:
        stop_server(cache)
