"""``_fs.realpath``: the kernel's answer where it has one, ``os.path.realpath``'s everywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelcache import _fs


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Files, links to them, a link loop and a dangling link; the working directory inside."""
    (tmp_path / "real" / "bin").mkdir(parents=True)
    (tmp_path / "real" / "lib").mkdir()
    (tmp_path / "real" / "bin" / "nvcc").write_text("#!/bin/sh\n")
    os.mkfifo(tmp_path / "real" / "fifo")  # opened for its name only: must not block
    (tmp_path / "toolkit").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "bin" / "nvcc.link").symlink_to("nvcc")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    monkeypatch.chdir(tmp_path / "toolkit" / "bin")
    return tmp_path


SPELLINGS = [
    "toolkit/bin/nvcc",
    "toolkit/bin/nvcc.link",
    "toolkit/bin/../lib",  # '..' after a link goes up from its target
    "toolkit/fifo",
    "toolkit/bin/nvcc/",  # a file named as a directory: not opened, realpath's answer
    "toolkit/missing/x",
    "loop",
    "loop/x",
    "dangling",
    "real/bin/./nvcc",
]
RELATIVE = ["nvcc", "../lib", ".", "", "missing"]


@pytest.mark.parametrize("spelling", SPELLINGS + [f"rel:{s}" for s in RELATIVE])
def test_the_same_answer_as_os_path_realpath(tree: Path, spelling: str) -> None:
    path = spelling[4:] if spelling.startswith("rel:") else str(tree / spelling)
    assert _fs.realpath(path) == os.path.realpath(path)


def test_an_existing_path_is_resolved_by_the_kernel(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def walked(path: str) -> str:
        raise AssertionError(f"walked {path} in Python")

    monkeypatch.setattr(os.path, "realpath", walked)
    assert _fs.realpath(str(tree / "toolkit/bin/nvcc.link")) == str(tree / "real/bin/nvcc")
    assert _fs.realpath("../lib") == str(tree / "real/lib")


def test_a_link_moved_between_calls_is_followed_anew(tree: Path) -> None:
    link = str(tree / "toolkit/bin/nvcc.link")
    assert _fs.realpath(link) == str(tree / "real/bin/nvcc")
    os.replace(tree / "toolkit/bin/nvcc.link", tree / "old.link")
    (tree / "real" / "bin" / "nvcc.link").symlink_to("../lib")
    assert _fs.realpath(link) == str(tree / "real/lib")


def test_without_o_path_python_walks(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fs, "_O_PATH", None)
    for spelling in SPELLINGS:
        path = str(tree / spelling)
        assert _fs.realpath(path) == os.path.realpath(path)


@pytest.mark.parametrize("named", ["/x/nvcc (deleted)", "anon_inode:[eventfd]"])
def test_a_name_that_is_no_path_any_more_is_walked_again(
    tree: Path, monkeypatch: pytest.MonkeyPatch, named: str
) -> None:
    # What /proc/self/fd says of a file unlinked since the open, or of no file at all.
    readlink = os.readlink

    def lying(path: str) -> str:
        return named if path.startswith("/proc/self/fd/") else readlink(path)

    monkeypatch.setattr(os, "readlink", lying)
    path = str(tree / "toolkit/bin/nvcc")
    assert _fs.realpath(path) == str(tree / "real/bin/nvcc")
