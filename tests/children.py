"""Child Python processes of the DSL tests: a script run with arguments, reporting one JSON line.

The parent starts several children (:func:`start`), lets them go at once by
creating a file each child waits for (:func:`wait_for`, in the child), and
reads the last line of each one's output as its report (:func:`finish`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def start(script: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's report (its last line of output, JSON), once it exited with 0."""
    try:
        out, err = proc.communicate(timeout=600)
    except BaseException:
        # A test stopped here (pytest-timeout, ^C): the child must not run on into the next
        # tests of this worker, using CPU, and warn there as an unwaited process.
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-4000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


#: How long the parent waits for the last child to get ready (:func:`release`), and so
#: how long the first one ready may have to wait for ``go`` (:func:`wait_for`).
READY_WAIT = 300.0


def wait_for(path: str) -> None:
    """In a child: say it is ready (``<path>.ready.<pid>``), then wait until ``path`` exists."""
    with open(f"{path}.ready.{os.getpid()}", "w"):
        pass
    # Its siblings may import torch or JAX for minutes on a loaded machine: as long
    # as the parent waits for them (it waited 300 s, this child only 120 s).
    deadline = time.monotonic() + READY_WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def release(go: Path, procs: list[subprocess.Popen[str]]) -> None:
    """In the parent: once every child said it is ready, let them all go (create ``go``)."""
    deadline = time.monotonic() + READY_WAIT
    while len(list(go.parent.glob(f"{go.name}.ready.*"))) < len(procs):
        assert time.monotonic() < deadline, "children never got ready"
        assert all(p.poll() is None for p in procs), [
            finish(p) for p in procs if p.poll() is not None
        ]
        time.sleep(0.05)
    go.touch()


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children waited for so far (nvcc, the linker)."""
    times = os.times()  # children's in clock ticks (10 ms); this process's to the nanosecond
    return time.process_time() + times.children_user + times.children_system
