"""kernelcache.nvcc.deps.record: a dependency is read once while its stat signature vouches
for its content (the launcher's server records compile after compile of the same headers),
and read again after any change, even one that keeps its size and mtime."""

from __future__ import annotations

import os
import time
import types
from pathlib import Path

import pytest

from kernelcache.keys import sha256
from kernelcache.nvcc import deps


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock 3 s ahead for ``deps``: files written now are old enough to vouch for
    (``_fs.TOO_NEW_NS``), without the test sleeping."""
    real = time.time_ns
    monkeypatch.setattr(deps, "time", types.SimpleNamespace(time_ns=lambda: real() + 3_000_000_000))
    monkeypatch.setattr(deps, "_RECORDED", {})


def _record(path: Path) -> tuple[list[object], bytes]:
    found = deps.record([str(path)], None, time.time_ns() + 4_000_000_000)
    assert found is not None
    rows, contents = found
    return rows[0], contents[str(path)]


def test_an_unchanged_dependency_is_read_once(tmp_path: Path, later: None) -> None:
    header = tmp_path / "h.cuh"
    header.write_bytes(b"#pragma once\n")
    first_row, first = _record(header)
    second_row, second = _record(header)
    assert second is first  # the same bytes: not read again (and scanned at once)
    assert second_row == first_row
    assert first_row[1] == sha256(b"#pragma once\n").hexdigest()


@pytest.mark.parametrize("how", ["same-size-and-mtime", "renamed-over", "grown"])
def test_any_change_is_read_again(tmp_path: Path, later: None, how: str) -> None:
    header = tmp_path / "h.cuh"
    header.write_bytes(b"#define N 1\n")
    _, first = _record(header)
    st = header.stat()
    if how == "same-size-and-mtime":  # only the ctime tells
        header.write_bytes(b"#define N 2\n")
        os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif how == "renamed-over":  # only the inode (and ctime) tell
        other = tmp_path / "new"
        other.write_bytes(b"#define N 3\n")
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        other.replace(header)
    else:
        header.write_bytes(b"#define N 10\n")
    row, second = _record(header)
    assert second == header.read_bytes() != first
    assert row[1] == sha256(second).hexdigest()


def test_a_file_too_new_to_vouch_for_is_read_each_time(tmp_path: Path) -> None:
    header = tmp_path / "h.cuh"
    header.write_bytes(b"#pragma once\n")
    _, first = _record(header)
    row, second = _record(header)
    assert second is not first
    assert row[2] is None  # recorded without a signature: the next lookup hashes it


def test_a_dependency_changed_after_the_compile_started_is_not_recorded(tmp_path: Path) -> None:
    header = tmp_path / "h.cuh"
    header.write_bytes(b"#pragma once\n")
    assert deps.record([str(header)], None, time.time_ns()) is None
