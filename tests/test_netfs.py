"""The fault-injecting filesystem of tests/netfs.py does what the shared-filesystem tests rely on.

Two mounts over one directory are two nodes: what one writes the other reads;
flock conflicts within a mount and, unless asked, not across; each fault mode
answers as the network filesystem it stands for; requests are counted per
mount; and nothing stays mounted or running after close.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from netfs import Faults, NetFS

Mount = Callable[..., NetFS]


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(f" {path} " in line for line in f)


def _conflicts(first: Path, second: Path) -> bool:
    """Whether an exclusive flock through ``second`` waits for one held through ``first``."""
    a, b = os.open(first, os.O_RDWR), os.open(second, os.O_RDWR)
    try:
        fcntl.flock(a, fcntl.LOCK_EX)
        try:
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(a)
        os.close(b)


def test_two_nodes_share_files_and_unmount_cleanly(two_nodes: Mount) -> None:
    fs = two_nodes()
    a, b = fs.nodes
    (a.path / "d").mkdir()
    (a.path / "d" / "x").write_bytes(b"from a")
    assert (b.path / "d" / "x").read_bytes() == b"from a"
    assert os.listdir(b.path / "d") == ["x"]
    assert (fs.backing / "d" / "x").read_bytes() == b"from a"
    counts = a.counts()
    assert counts["mkdir"] == 1
    assert counts["create"] == 1
    assert counts["write"] >= 1
    assert b.counts()["read"] >= 1
    daemons = [node.process for node in fs.nodes]
    fs.close()
    assert not _mounted(a.path)
    assert not _mounted(b.path)
    assert all(p is not None and p.poll() is not None for p in daemons)


@pytest.mark.parametrize(
    ("flock", "across"),
    [pytest.param("local", False, id="local"), pytest.param("shared", True, id="shared")],
)
def test_flock_conflicts_within_a_mount_and_across_only_when_shared(
    two_nodes: Mount, flock: str, across: bool
) -> None:
    # "local" is FUSE's own behaviour for a filesystem without lock operations:
    # the kernel keeps the lock per mount, so the other node never sees it.
    fs = two_nodes(flock)
    a, b = fs.nodes
    (a.path / "lock").write_bytes(b"")
    assert _conflicts(a.path / "lock", a.path / "lock")
    assert _conflicts(a.path / "lock", b.path / "lock") is across
    assert (a.counts()["flock"] > 0) is across


def test_flock_none_fails_with_enolck(two_nodes: Mount) -> None:
    fs = two_nodes("none")
    path = fs.nodes[0].path / "lock"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="No locks available") as caught:
            fcntl.flock(fd, fcntl.LOCK_EX)
        assert caught.value.errno == errno.ENOLCK
    finally:
        os.close(fd)


def test_estale_after_the_other_node_replaces_an_open_file(two_nodes: Mount) -> None:
    fs = two_nodes(faults=Faults(stale_unlinked=True))
    a, b = fs.nodes
    (a.path / "x").write_bytes(b"old")
    fd = os.open(a.path / "x", os.O_RDONLY)
    try:
        (b.path / "new").write_bytes(b"new")
        os.rename(b.path / "new", b.path / "x")
        with pytest.raises(OSError, match="Stale file handle") as caught:
            os.pread(fd, 3, 0)
        assert caught.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    assert (a.path / "x").read_bytes() == b"new"  # a fresh open finds the new file
    # This node's own removal of an open file leaves it readable (an NFS client's silly rename).
    fd = os.open(a.path / "x", os.O_RDONLY)
    try:
        os.unlink(a.path / "x")
        assert os.pread(fd, 3, 0) == b"new"
    finally:
        os.close(fd)
    assert a.counts()["injected_estale_unlinked"] == 1


def test_ebusy_on_removing_a_file_open_on_the_other_node(two_nodes: Mount) -> None:
    fs = two_nodes(faults=Faults(ebusy_open=True))
    a, b = fs.nodes
    (a.path / "x").write_bytes(b"x")
    fd = os.open(b.path / "x", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="busy") as caught:
            os.unlink(a.path / "x")
        assert caught.value.errno == errno.EBUSY
        with pytest.raises(OSError, match="busy") as caught:
            os.rename(a.path / "x", a.path / "y")
        assert caught.value.errno == errno.EBUSY
    finally:
        os.close(fd)
    # The kernel sends the release after close() returns: the file is free soon, not at once.
    deadline = time.monotonic() + 30
    while True:
        try:
            os.unlink(a.path / "x")
            break
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    assert a.counts()["injected_ebusy"] >= 2


def test_random_faults_hit_only_the_named_requests(two_nodes: Mount) -> None:
    a, b = two_nodes().nodes
    a.set(Faults(eio_ppm=1_000_000, eio_ops=("read",)))
    (a.path / "x").write_bytes(b"x")
    with pytest.raises(OSError, match="Input/output error") as caught:
        (a.path / "x").read_bytes()
    assert caught.value.errno == errno.EIO
    assert (b.path / "x").read_bytes() == b"x"  # the other mount's faults are its own
    a.set(Faults())
    assert (a.path / "x").read_bytes() == b"x"
    with pytest.raises(ValueError, match="unknown request kinds"):
        Faults(eio_ops=("reed",)).pack()


def test_attributes_lag_the_other_node(two_nodes: Mount) -> None:
    fs = two_nodes(faults=Faults(attr_timeout_ms=60_000))
    a, b = fs.nodes
    (a.path / "x").write_bytes(b"1")
    assert (b.path / "x").stat().st_size == 1
    (a.path / "x").write_bytes(b"22")
    assert (b.path / "x").stat().st_size == 1  # b trusts what it saw, as NFS within actimeo
    assert not (b.path / "y").exists()
    (a.path / "y").write_bytes(b"")
    assert not (b.path / "y").exists()  # and a name it found missing


def test_requests_are_counted_per_mount(two_nodes: Mount) -> None:
    fs = two_nodes(faults=Faults(latency_us=1000))
    a, b = fs.nodes
    (a.path / "x").write_bytes(b"x")
    before, other = a.counts(), b.counts()
    assert (a.path / "x").read_bytes() == b"x"
    # lookup (maybe), open, getattr, read: a few round trips on a, none on b.
    assert 2 <= a.round_trips(before) <= 8
    assert b.round_trips(other) == 0
