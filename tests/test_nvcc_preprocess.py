"""The preprocessed key's passes: run side by side, each output in its pass's place (issue 23)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
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


@pytest.mark.parametrize(
    "line",
    [
        pytest.param('"/usr/local/cuda/bin"/gcc -E -x c++ "-I/a b/include" -o k.ii', id="nvcc"),
        pytest.param("a  \t b\n c\r", id="blanks"),
        pytest.param("'it''s' \"in 'single'\" 'in \"double\"'", id="quotes-in-quotes"),
        pytest.param("a\"b c\"d e'f g'h", id="quotes-mid-word"),
        pytest.param("\"\" '' x", id="empty-words"),
        pytest.param(r'\a\ b "\\ \" \n \$" \'\\', id="backslashes"),
        pytest.param("'\\'", id="backslash-in-single"),
        pytest.param("", id="nothing"),
        pytest.param('"unclosed', id="unclosed-double"),
        pytest.param("'unclosed", id="unclosed-single"),
        pytest.param("trailing\\", id="trailing-backslash"),
        pytest.param('"ends in \\', id="backslash-ending-double"),
    ],
)
def test_a_command_line_splits_as_shlex_splits_it(line: str) -> None:
    """The dry run's lines are split without importing shlex (and re), word for word alike."""
    assert _words(preprocess.split, line) == _words(shlex.split, line)


def _words(split: Callable[[str], list[str]], line: str) -> list[str] | type[ValueError]:
    """The words ``split`` finds in ``line``, or ``ValueError`` if it refuses the line."""
    try:
        return split(line)
    except ValueError:
        return ValueError


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_line_of_a_real_dry_run_splits_as_shlex_splits_it(tmp_path: Path) -> None:
    (tmp_path / "k.cu").write_text("#include <cuda_runtime.h>\n__global__ void k() {}\n")
    keep = ["--keep", "--keep-dir", str(tmp_path), "-MD", "-MF", str(tmp_path / "k.d")]
    args = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80"]
    proc = subprocess.run(
        [
            "nvcc",
            *args,
            "-c",
            str(tmp_path / "k.cu"),
            "-o",
            str(tmp_path / "k.o"),
            *keep,
            "--dryrun",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line[3:].strip() for line in proc.stderr.splitlines() if line.startswith("#$ ")]
    assert len(lines) > 10
    for line in lines:
        assert preprocess.split(line) == shlex.split(line)
    planned = preprocess.read_dryrun(proc.stderr.encode(), dict(os.environ))
    assert planned is not None
    assert len(planned[0]) == 3  # the host pass, then one per architecture
    arch = [[w for w in words if w.startswith("-D__CUDA_ARCH__=")] for words in planned[0]]
    assert arch == [[], ["-D__CUDA_ARCH__=800"], ["-D__CUDA_ARCH__=900"]]
