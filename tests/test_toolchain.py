"""Toolchain probes: stable identities, failure labels, the on-disk memo."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kernelcache import _fs, toolchain


@pytest.fixture(autouse=True)
def private_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain, "_memo", None)


def fake_compiler(path: Path, version: str) -> str:
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_failed_probe_label() -> None:
    assert toolchain.failed(FileNotFoundError("x")) == "probe_failed:FileNotFoundError"
    assert toolchain.nvcc("/nonexistent/nvcc").startswith("probe_failed:")
    assert toolchain.executable("/nonexistent/gcc") == "probe_failed:FileNotFoundError"


def test_executable_identity_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    cc = fake_compiler(tmp_path / "cc", "cc 1.0")
    first = toolchain.executable(cc)
    assert "cc 1.0" in first
    assert "sha256:" in first
    assert str(tmp_path) not in first
    assert toolchain.executable(cc) == first
    fake_compiler(tmp_path / "cc", "cc 1.1")
    assert toolchain.executable(cc) != first


def test_memo_skips_the_version_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)  # files here are seconds old
    cc = fake_compiler(tmp_path / "cc", "cc 2.0")
    identity = toolchain.executable(cc)
    memo = json.loads(Path(toolchain.memo_path()).read_text())
    assert memo["executables"][os.path.realpath(cc)]["identity"] == identity

    def no_run(path: str) -> str:
        raise AssertionError("the memo should have answered")

    monkeypatch.setattr(toolchain, "_run_version", no_run)
    monkeypatch.setattr(toolchain, "_memo", None)  # as in a new process
    assert toolchain.executable(cc) == identity
    # An edit changes the stat signature, so the memo is not trusted.
    fake_compiler(tmp_path / "cc", "cc 2.1")
    with pytest.raises(AssertionError, match="memo"):
        toolchain.executable(cc)


def test_wrapper_script_targets_are_part_of_the_identity(tmp_path: Path) -> None:
    real = fake_compiler(tmp_path / "real-nvcc", "nvcc 13.0")
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    before = toolchain.executable(str(wrapper))
    fake_compiler(tmp_path / "real-nvcc", "nvcc 13.0")  # same output, new file...
    Path(real).write_text(Path(real).read_text() + "# patched\n")  # ...different content
    assert toolchain.executable(str(wrapper)) != before


def test_damaged_memo_is_ignored(tmp_path: Path) -> None:
    path = Path(toolchain.memo_path())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    cc = fake_compiler(tmp_path / "cc", "cc 3.0")
    assert "cc 3.0" in toolchain.executable(cc)


def test_real_probes() -> None:
    pytest.importorskip("cuda.bindings")
    assert toolchain.nvrtc().startswith(("nvrtc 13.", "nvrtc 12.", "probe_failed:"))
    assert toolchain.nvrtc() == toolchain.nvrtc()
    for probe in (toolchain.driver(), toolchain.gpu_arch()):
        assert probe.startswith(("cuda-driver", "sm_", "probe_failed:"))
    assert toolchain.triton().startswith(("triton ", "probe_failed:"))
    nvcc = toolchain.nvcc()
    assert "release" in nvcc or nvcc.startswith("probe_failed:")
