"""Filesystem detection (kernelcache.fstype): what each cache directory lives on."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import netfs
from kernelcache import _fs, fstype
from kernelcache.stores.disk import DiskStore


@pytest.fixture
def fresh() -> Iterator[None]:
    """Forget what this process detected, and what it warned about, before and after."""
    fstype.forget()
    yield
    fstype.forget()


def fake_mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> None:
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(fstype, "_MOUNTINFO", str(path))


def dev_of(path: Path) -> str:
    dev = os.stat(path).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


@pytest.mark.parametrize(
    ("name", "network"),
    [
        pytest.param("nfs", True, id="nfs"),
        pytest.param("nfs4", True, id="nfs4"),
        pytest.param("lustre", True, id="lustre"),
        pytest.param("gpfs", True, id="gpfs"),
        pytest.param("beegfs", True, id="beegfs"),
        pytest.param("ceph", True, id="cephfs"),
        pytest.param("cifs", True, id="cifs"),
        pytest.param("smb3", True, id="smb3"),
        pytest.param("9p", True, id="9p"),
        pytest.param("fuse", True, id="fuse"),
        pytest.param("fuse.sshfs", True, id="sshfs"),
        pytest.param("fuse.glusterfs", True, id="glusterfs"),
        pytest.param("fuseblk", False, id="fuseblk"),
        pytest.param("ext4", False, id="ext4"),
        pytest.param("xfs", False, id="xfs"),
        pytest.param("tmpfs", False, id="tmpfs"),
        pytest.param("overlay", False, id="overlay"),
    ],
)
def test_network_types(name: str, network: bool) -> None:
    assert fstype.is_network_type(name) is network


def test_this_machine_is_detected_as_it_is(tmp_path: Path, fresh: None) -> None:
    with open("/proc/self/mountinfo") as f:
        fields = [line.split(" ") for line in f]
    wanted = dev_of(tmp_path)
    expected = {f[2]: f[f.index("-", 6) + 1] for f in fields}.get(wanted)
    found = fstype.detect(str(tmp_path))
    assert found.name == expected
    assert not found.network
    assert fstype.report(str(tmp_path)) == {"type": expected, "network": False}


def test_the_device_line_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    fake_mountinfo(
        tmp_path,
        monkeypatch,
        [
            "27 1 999:0 / / rw,relatime - ext4 /dev/vda rw",
            # The device's numbers as another line's source: only the third field decides.
            f"28 1 999:2 / /other rw,relatime - tmpfs {dev_of(tmp_path)} rw",
            f"90 27 {dev_of(tmp_path)} / /some\\040where rw,relatime shared:5 - nfs4 srv:/home rw",
        ],
    )
    found = fstype.detect(str(tmp_path / "not" / "made" / "yet"))  # its nearest ancestor
    assert (found.name, found.network, str(found)) == ("nfs4", True, "nfs4 (network)")
    assert fstype.network_device(os.stat(tmp_path).st_dev)
    assert _fs.too_new(os.stat(tmp_path), time.time_ns() + 10**12), "an NFS stat never vouches"
    assert not _fs.too_new(os.stat(tmp_path), time.time_ns() + 10**12, network=False)


def test_no_device_line_falls_back_to_the_longest_mount_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    point = str(tmp_path).replace(" ", "\\040")
    fake_mountinfo(
        tmp_path,
        monkeypatch,
        [
            "27 1 999:0 / / rw,relatime - ext4 /dev/vda rw",
            f"91 27 999:1 / {point} rw,relatime - lustre 10.0.0.1@tcp:/fs rw,flock",
            "garbage",
        ],
    )
    assert fstype.detect(str(tmp_path)) == fstype.FsType("lustre", True)
    assert not fstype.network_device(12345)  # no line names it, and no path to go by


def test_without_mountinfo_nothing_is_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    monkeypatch.setattr(fstype, "_MOUNTINFO", str(tmp_path / "absent"))
    assert fstype.detect(str(tmp_path)) == fstype.UNKNOWN
    assert fstype.detect("/proc/self/fd/999999/x") == fstype.UNKNOWN


def test_a_network_directory_is_warned_about_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fstype.assume(str(tmp_path), "gpfs")
    with caplog.at_level(logging.WARNING, logger="kernelcache"):
        for _ in range(3):
            fstype.warn_if_network(str(tmp_path))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "gpfs, a network filesystem" in warnings[0]
    assert "node-local" in warnings[0]
    assert "KERNELCACHE_REMOTE" in warnings[0]


def test_stats_shows_the_filesystem(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c"):
        pass  # a cache is there: `stats` of no cache says so and exits 1
    env = {**os.environ, "KERNELCACHE_DIR": str(tmp_path / "c")}
    run = [sys.executable, "-m", "kernelcache", "stats"]
    report = json.loads(
        subprocess.run([*run, "--json"], env=env, capture_output=True, text=True, check=True).stdout
    )
    expected = fstype.detect(str(tmp_path))
    assert report["filesystem"] == {"type": expected.name, "network": False}
    human = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert f"(on {expected.name})" in human.splitlines()[0]


def _config_filesystem(directory: Path) -> dict[str, object]:
    env = {**os.environ, "KERNELCACHE_DIR": str(directory)}
    run = [sys.executable, "-m", "kernelcache", "config", "--json"]
    rows: list[dict[str, object]] = json.loads(
        subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    )
    (row,) = [r for r in rows if r["name"] == "filesystem"]
    return row


def test_config_shows_the_filesystem(tmp_path: Path, two_nodes: Callable[..., netfs.NetFS]) -> None:
    local = _config_filesystem(tmp_path / "c")
    assert local["value"] == fstype.detect(str(tmp_path)).name
    assert local["network"] is False
    node = two_nodes().nodes[0].path
    remote = _config_filesystem(node / "c")
    assert remote["value"] == "fuse.netfs"
    assert remote["network"] is True
    assert remote["source"] == "detected (a network filesystem)"


@pytest.mark.parametrize("network", [False, True], ids=["local", "network"])
def test_a_network_stat_never_pins_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None, network: bool
) -> None:
    """Extracted copies (and every other memo keyed by a stat signature) are re-read on a
    network filesystem: another node's edit may not show in a stat there."""
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)  # files written here are seconds old
    if network:
        fstype.assume(str(tmp_path), "nfs4")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(b"verified")
    pins: dict[str, tuple[int, int, int, int, int]] = {}
    assert _fs.holds(str(path), b"verified", pins)
    assert bool(pins) is not network
    from kernelcache.triton.pinned import YOUNG, verified_signature

    outcome = verified_signature(str(path), b"verified", time.time_ns())
    assert (outcome == YOUNG) is network
