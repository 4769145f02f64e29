"""kernelcache.nvcc.procs: the launcher caller's child processes, real ones, without subprocess."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from kernelcache.nvcc import procs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the launcher is Linux-only")


def test_each_result_is_its_commands_status_and_output_in_order() -> None:
    results = procs.run_all(
        [
            ["sh", "-c", "echo out; echo err >&2; exit 3"],
            ["sh", "-c", "printf second"],
            ["sh", "-c", 'kill -TERM "$$"'],
        ]
    )
    assert results == [(3, b"out\n", b"err\n"), (0, b"second", b""), (-signal.SIGTERM, b"", b"")]


def test_output_larger_than_a_pipe_on_both_streams_is_read_whole() -> None:
    """Both pipes are drained as they fill: a child writing 1 MB to each never blocks."""
    size = 1 << 20
    ran = procs.run(["sh", "-c", f"head -c {size} /dev/zero; head -c {size} /dev/zero >&2"])
    assert ran is not None
    assert (ran[0], len(ran[1]), len(ran[2])) == (0, size, size)


def test_a_program_that_cannot_start_says_why() -> None:
    ran = procs.run(["/nonexistent/nvcc", "--version"])
    assert ran is not None
    status, out, err = ran
    assert (status, out) == (procs.CANNOT_RUN, b"")
    assert err.startswith(b"kernelcache: cannot run /nonexistent/nvcc: ")


def test_a_bare_name_is_found_on_the_childs_path(tmp_path: Path) -> None:
    tool = tmp_path / "only-here"
    tool.write_text("#!/bin/sh\necho found\n")
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    assert procs.run(["only-here"], env) == (0, b"found\n", b"")
    assert procs.run(["only-here"])[0] == procs.CANNOT_RUN  # type: ignore[index]


def test_the_environment_given_is_the_childs() -> None:
    env = {"PATH": "/usr/bin:/bin", "KC_PROBE": "given"}
    assert procs.run(["sh", "-c", 'printf "%s" "$KC_PROBE"'], env) == (0, b"given", b"")


def test_sigpipe_is_back_to_its_default_in_the_child() -> None:
    """Python ignores SIGPIPE; a child must not inherit that (``subprocess`` resets it too)."""
    ran = procs.run(["sh", "-c", 'grep SigIgn "/proc/$$/status"'])
    assert ran is not None
    ignored = int(ran[1].split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    assert not ignored & (1 << (signal.SIGXFSZ - 1))


def test_at_most_limit_run_at_once(tmp_path: Path) -> None:
    """With a limit of 1, commands that each hold a lock directory for a while never
    collide; without one, commands that each wait (up to 10 s) until all three have
    started all meet, which one at a time they could not."""
    hold = f'mkdir "{tmp_path}/held" || exit 9; sleep 0.3; rmdir "{tmp_path}/held"'
    assert [r[0] for r in procs.run_all([["sh", "-c", hold]] * 3, limit=1) if r] == [0, 0, 0]
    meet = (
        f'touch "{tmp_path}/started-$$"; i=0; '
        f'while [ "$(ls "{tmp_path}" | grep -c started-)" -lt 3 ]; do '
        "i=$((i + 1)); [ $i -gt 1000 ] && exit 9; sleep 0.01; done"
    )
    assert [r[0] for r in procs.run_all([["sh", "-c", meet]] * 3) if r] == [0, 0, 0]


def test_a_timeout_kills_and_reaps_what_still_runs(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    began = time.monotonic()
    results = procs.run_all(
        [["sh", "-c", f'echo $$ > "{pid_file}"; exec sleep 30'], ["true"]], timeout=3
    )
    assert time.monotonic() - began < 30  # not the sleep's 30 s: killed at the timeout
    assert results == [None, (0, b"", b"")]
    with pytest.raises(ProcessLookupError):  # killed, and reaped: no zombie left behind
        os.kill(int(pid_file.read_text()), 0)


def test_a_private_directory_is_new_this_users_only_and_in_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first, second = procs.make_private_dir(), procs.make_private_dir()
    assert first != second
    for made in (first, second):
        assert os.path.dirname(made) == str(tmp_path)
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_remove_tree_removes_everything_and_follows_no_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f.ii").write_text("x")
    (tree / "top.cubin").write_bytes(b"\0")
    (tree / "link").symlink_to(outside)
    (tree / "a" / "file-link").symlink_to(outside / "keep.txt")
    procs.remove_tree(str(tree))
    assert not tree.exists()
    assert (outside / "keep.txt").read_text() == "mine"
    procs.remove_tree(str(tree))  # gone already: nothing to do, no error
