"""The preprocessed key's passes: run side by side, each output in its pass's place (issue 23)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kernelcache.nvcc import preprocess

# Each pass says it started, then waits (up to 10 s) for the other to start too: one after
# the other, the first would give up and fail, and there would be no digests at all.
_MEET = (
    "import os, sys, time\n"
    "me, other = sys.argv[1], sys.argv[2]\n"
    "open(me, 'w').close()\n"
    "deadline = time.monotonic() + 10\n"
    "while not os.path.exists(other):\n"
    "    if time.monotonic() > deadline:\n"
    "        sys.exit(1)\n"
    "    time.sleep(0.01)\n"
    "sys.stdout.write('output of ' + os.path.basename(me))\n"
)


def _step(tmp_path: Path, me: str, other: str) -> list[str]:
    return [sys.executable, "-c", _MEET, str(tmp_path / me), str(tmp_path / other)]


def test_the_passes_run_side_by_side_and_keep_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    steps = [_step(tmp_path, "host", "sm_90"), _step(tmp_path, "sm_90", "host")]
    assert preprocess.run_all(steps, dict(os.environ)) == [b"output of host", b"output of sm_90"]


def test_a_failed_pass_gives_no_digests(tmp_path: Path) -> None:
    ok = [sys.executable, "-c", "print('fine')"]
    failed = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert preprocess.run_all([ok, failed, ok], dict(os.environ)) is None
    assert preprocess.run_all([[str(tmp_path / "no-such-compiler")]], dict(os.environ)) is None


def test_one_cpu_runs_them_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As many at once as there are CPUs: with one, the passes that must meet cannot."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    steps = [
        [sys.executable, "-c", _MEET.replace("+ 10", "+ 0.5"), str(tmp_path / a), str(tmp_path / b)]
        for a, b in (("host", "sm_90"), ("sm_90", "host"))
    ]
    assert preprocess.run_all(steps, dict(os.environ)) is None
