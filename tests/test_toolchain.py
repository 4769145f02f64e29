"""Toolchain probes: stable identities, failure labels, the on-disk memo."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kernelcache import _fs, toolchain
from other_user import OTHER, needs_other_user, others_dir, shared_base

__all__ = ["shared_base"]  # the fixture, for pytest


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


@pytest.mark.parametrize(
    "around",
    [
        b'exec %s "$@"',
        b'CUDA="%s"; exec $CUDA --x=%s -I../rel%s',
        b"# '%s'\t%s\x00%s\xff%s\xe9%s",
        b"relative%s:%s=%s,%s;%s",
        b"a / lone slash, a/ trailing one, // and /",
    ],
)
def test_a_wrappers_targets_are_the_paths_a_regex_finds(tmp_path: Path, around: bytes) -> None:
    # The scan replaced re.findall (compiling it cost a fresh process's first hit ~0.2 ms).
    import re

    names = ["real-nvcc", "b+c.d", "x-y/z_1", "not-there", "real-nvcc"]
    (tmp_path / "x-y").mkdir()
    paths = [os.fsencode(tmp_path / name) for name in names]
    for path in paths[:3]:
        Path(os.fsdecode(path)).write_text("")
    body = around % tuple(paths[: around.count(b"%s")])
    wrapper = tmp_path / "nvcc"
    wrapper.write_bytes(b"#!/bin/sh\n" + body + b"\n")
    expected: list[str] = []
    for raw in re.findall(rb"(/[\w.+\-/]+)", wrapper.read_bytes()[2:]):
        if os.path.isfile(raw) and os.fsdecode(raw) not in expected:
            expected.append(os.fsdecode(raw))
    assert toolchain.script_targets(str(wrapper)) == expected
    # Not vacuous: the interpreter, and a planted file wherever one was planted.
    assert expected[0] == "/bin/sh"
    assert len(expected) >= (2 if b"%s" in around else 1)


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


# The memo follows the trust rule (issue 19) ------------------------------------------

FORGED = "a compiler identity forged by another user"


def _forged_memo(cc: str) -> bytes:
    real = os.path.realpath(cc)
    sigs = [list(_fs.signature(os.stat(p))) for p in [real, *toolchain.script_targets(real)]]
    entry = {"sigs": sigs, "identity": FORGED}
    return json.dumps({"version": 2, "files": {}, "executables": {real: entry}}).encode()


def _plant_memo(base: Path, how: str, data: bytes) -> Path:
    """A cache directory holding a forged memo, as the second user could leave it; returns it."""
    if how == "directory-of-another-user":
        cache = others_dir(base / "kc", 0o755)
    elif how == "ancestor-others-can-write":
        cache = others_dir(base / "shared", 0o777) / "kc"
        cache.mkdir(mode=0o700)
    else:
        cache = base / "kc"
        cache.mkdir(mode=0o700)
    memo = cache / toolchain.MEMO_FILE
    if how == "memo-is-a-link":
        (base / "elsewhere.json").write_bytes(data)
        memo.symlink_to(base / "elsewhere.json")
        return cache
    memo.write_bytes(data)
    if how in ("directory-of-another-user", "ancestor-others-can-write", "memo-of-another-user"):
        os.chown(memo, OTHER, OTHER)
    if how == "memo-others-can-write":
        memo.chmod(0o666)
    return cache


@needs_other_user
@pytest.mark.parametrize(
    "how",
    [
        "directory-of-another-user",
        "ancestor-others-can-write",
        "memo-of-another-user",
        "memo-others-can-write",
        "memo-is-a-link",
    ],
)
def test_a_forged_memo_never_names_the_compiler(
    shared_base: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)  # files here are seconds old
    cc = fake_compiler(shared_base / "cc", "cc 4.0")
    forged = _forged_memo(cc)
    cache = _plant_memo(shared_base, how, forged)
    monkeypatch.setenv("KERNELCACHE_DIR", str(cache))
    before = sorted(p.name for p in cache.iterdir())
    identity = toolchain.executable(cc)
    assert identity != FORGED
    assert "cc 4.0" in identity
    if how in ("directory-of-another-user", "ancestor-others-can-write"):
        assert sorted(p.name for p in cache.iterdir()) == before  # nothing written there
        assert (cache / toolchain.MEMO_FILE).read_bytes() == forged
    if how == "memo-is-a-link":
        assert (shared_base / "elsewhere.json").read_bytes() == forged  # never written through


def test_read_only_writes_no_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)
    monkeypatch.setenv("KERNELCACHE_READONLY", "1")
    cc = fake_compiler(tmp_path / "cc", "cc 5.0")
    assert "cc 5.0" in toolchain.executable(cc)
    assert not (tmp_path / "cache").exists()  # not even the directory
    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setattr(toolchain, "_memo", None)
    assert "cc 5.0" in toolchain.executable(cc)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setenv("KERNELCACHE_READONLY", "maybe")  # unsure: write nothing either
    monkeypatch.setattr(toolchain, "_memo", None)
    toolchain.executable(cc)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_memo_helper_round_trips_in_a_trusted_directory(tmp_path: Path) -> None:
    from kernelcache import _memos

    assert _memos.load("x.json") == {}
    assert _memos.save("x.json", {"a": [1, 2]})
    assert _memos.load("x.json") == {"a": [1, 2]}
    assert stat.S_IMODE((tmp_path / "cache" / "x.json").stat().st_mode) == 0o600
    (tmp_path / "cache" / "x.json").write_text("[1]")  # not an object
    assert _memos.load("x.json") == {}
    (tmp_path / "cache" / "x.json").write_bytes(b"{" * (_memos.MAX_BYTES + 1))
    assert _memos.load("x.json") == {}


def _try_lock_elsewhere(name: str) -> bool:
    """Whether another process gets memo ``name``'s lock without waiting."""
    code = (
        "from kernelcache import _memos\n"
        f"with _memos.exclusive({name!r}, timeout=0) as locked:\n"
        "    print(locked)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"True": True, "False": False}[out.stdout.strip()]


def test_the_memo_lock_excludes_other_processes_not_forked_children(tmp_path: Path) -> None:
    from kernelcache import _memos

    with _memos.exclusive("x.json") as locked:
        assert locked
        assert (tmp_path / "cache" / "x.json.lock").is_file()
        assert _try_lock_elsewhere("x.json") is False  # held: the other process gives up
        # A child forked while the lock is held closes its copy: it cannot keep the lock.
        hold, release = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            os.close(release)
            os.read(hold, 1)
            os._exit(0)
    os.close(hold)
    try:
        assert _try_lock_elsewhere("x.json") is True  # released, though the child lives on
    finally:
        os.close(release)
        os.waitpid(child, 0)


def test_the_memo_lock_is_never_taken_through_a_link(tmp_path: Path) -> None:
    from kernelcache import _memos

    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "x.json.lock").symlink_to(tmp_path / "elsewhere")
    with _memos.exclusive("x.json") as locked:
        assert not locked
    assert not (tmp_path / "elsewhere").exists()
