"""An exception raised inside the trust walk comes out as itself (issue 40).

A signal's handler runs between any two bytecodes of the main thread: SIGTERM's
SystemExit in the launcher's server, Ctrl-C's KeyboardInterrupt anywhere. The walk
(:func:`kernelcache._trust.open_dir`) once closed a parent descriptor before it
named the child, so an exception in between made its ``finally`` close that
number again: EBADF, an ``OSError`` that callers treat as a miss or an unusable
directory, and the exception was gone (a server stopped there served on until
idle). The seam here is the one call between the two, raising as a handler would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelcache import _trust


class Interrupted(BaseException):
    """What a signal's handler raises (as SystemExit and KeyboardInterrupt are: not an Exception)."""


def test_an_exception_at_any_step_of_the_walk_comes_out_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a" / "b"
    target.mkdir(parents=True)
    real = os.path.normpath
    calls: list[str] = []

    def counted(path: str) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(os.path, "normpath", counted)
    fd = _trust.open_dir(str(target))
    assert fd is not None
    os.close(fd)
    steps = len(calls)
    assert steps >= 3  # one per component of a tmp_path, at least
    for step in range(1, steps + 1):
        seen: list[str] = []

        def interrupted(path: str, step: int = step, seen: list[str] = seen) -> str:
            seen.append(path)
            if len(seen) == step:
                raise Interrupted(step)
            return real(path)

        monkeypatch.setattr(os.path, "normpath", interrupted)
        with pytest.raises(Interrupted):
            _trust.open_dir(str(target))
