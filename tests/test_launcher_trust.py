"""The launcher never runs another user's program, writes through a link, or trusts a client
that cannot start (issue 19, items 6, 7 and 9), with a real second uid and real processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher_env import (
    CUBIN,
    ROOT,
    Project,
    answered,
    clean_env,
    listening,
    make_bin,
    server_pid,
    starting_or_running,
    stop_server,
    wait_for,
)
from other_user import OTHER, as_other, needs_other_user, others_dir, shared_base

__all__ = ["shared_base"]  # the fixture, for pytest

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the launcher's front is Linux-only"),
    needs_other_user,
]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
COMPILER = next(filter(None, (shutil.which(c) for c in ("cc", "gcc"))), None)


def _proc(name: str) -> str:
    try:
        return Path(f"/proc/sys/kernel/{name}").read_text().split("\n")[0]
    except OSError:
        return ""


def client_name() -> str:
    """The compiled client's file name as ``bin/kernelcache`` forms it on this machine."""
    found = re.search(
        r"f=\$c/(launcher-client-[0-9a-f]{16}-\S+)", (ROOT / "bin/kernelcache").read_text()
    )
    assert found is not None
    machine = _proc("arch") or "unknown"
    values = {
        "h": _proc("hostname"),
        "m": machine,
        "o": _proc("ostype"),
        "l": "musl" if os.path.exists(f"/lib/ld-musl-{machine}.so.1") else "gnu",
        "b": _proc("random/boot_id"),
    }
    return re.sub(r"\$(\w)", lambda m: values[m.group(1)], found.group(1))


def _script(path: Path, body: str, mode: int = 0o1755) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    os.link(path, path.with_name(f"{path.name}.ok-{_proc('random/boot_id')}"))
    return path


def _fake_nvcc(where: Path) -> Path:
    where.mkdir()
    nvcc = where / "nvcc"
    nvcc.write_text('#!/bin/sh\necho "fake nvcc: $*"\n')
    nvcc.chmod(0o755)
    return nvcc


SWAPPER = """
import os, sys, time
os.chdir(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
swaps = 0
while time.monotonic() < deadline and not os.path.exists("stop"):
    os.rename("kc", "kc.real"); os.rename("evil", "kc")
    os.rename("kc", "evil"); os.rename("kc.real", "kc")
    swaps += 1
print(swaps)
"""


@pytest.mark.slow
def test_a_parent_others_can_write_cannot_swap_in_their_program(shared_base: Path) -> None:
    """The issue's race: another user owns a 0777 parent of the cache directory and swaps the
    directory between the front's checks and its exec. Their program must never run as you."""
    shared = others_dir(shared_base / "shared", 0o777)
    ours = shared / "kc"
    ours.mkdir(mode=0o700)
    name = client_name()
    _script(ours / name, f'echo ours > "{shared_base}/ours-$$"', mode=0o1700)
    pwned = shared_base / "pwned"
    as_other("mkdir", "-m", "755", str(shared / "evil"))
    evil = shared / "evil" / name
    as_other(
        "sh", "-c", f'printf "#!/bin/sh\\ntouch {pwned}-\\$\\$\\n" > "{evil}"; chmod 1755 "{evil}"'
    )
    as_other("ln", str(evil), f"{evil}.ok-{_proc('random/boot_id')}")
    front = make_bin(shared_base / "bin")
    nvcc = _fake_nvcc(shared_base / "fakebin")
    env = clean_env(ours, KERNELCACHE_SERVER="0")
    setpriv = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"]
    swapper = subprocess.Popen([*setpriv, sys.executable, "-c", SWAPPER, str(shared), "90"])
    calls, deadline = 0, time.monotonic() + 60
    try:
        while calls < 200 and time.monotonic() < deadline:
            subprocess.run([str(front), str(nvcc), "--version"], env=env, capture_output=True)
            calls += 1
    finally:
        as_other("touch", str(shared / "stop"))
        swapper.wait(timeout=120)
    ran_ours = len(list(shared_base.glob("ours-*")))
    print(f"{calls} calls, {ran_ours} through the client of ours")
    assert not list(shared_base.glob("pwned-*")), f"their program ran as you ({calls} calls)"
    assert ran_ours > 0  # the front did run the client of the trusted moments... through fd 9
    assert ran_ours < calls  # ...and the Python client the others


@needs_nvcc
@pytest.mark.parametrize("how", ["ancestor-others-can-write", "directory-of-another-user"])
def test_an_untrusted_directory_gets_nothing_but_plain_nvcc_and_one_line(
    shared_base: Path, how: str
) -> None:
    if how == "ancestor-others-can-write":
        cache = others_dir(shared_base / "shared", 0o777) / "kc"
        cache.mkdir(mode=0o700)
    else:
        cache = others_dir(shared_base / "kc", 0o755)
    project = Project(shared_base)
    project.env = clean_env(cache)
    plain = subprocess.run(["nvcc", *CUBIN], cwd=project.project, capture_output=True, check=True)
    cold = (project.project / "k.cubin").read_bytes()
    for _ in range(2):
        (project.project / "k.cubin").unlink()
        proc = project.run()
        assert proc.returncode == 0, proc.stderr
        assert (project.project / "k.cubin").read_bytes() == cold
        warning = [line for line in proc.stderr.splitlines() if line.startswith(b"kernelcache:")]
        assert len(warning) == 1, proc.stderr
        assert b"refusing" in warning[0]
        assert proc.stderr.replace(warning[0] + b"\n", b"") == plain.stderr
    assert list(cache.iterdir()) == []  # no log, socket, lock, memo, statistics or entries
    assert server_pid(cache) is None


@pytest.fixture
def outside(shared_base: Path) -> Iterator[Path]:
    """A root-owned 0600 file outside the cache, the target of planted links."""
    target = shared_base / "outside"
    target.write_text("untouched\n")
    target.chmod(0o600)
    before = target.stat()
    yield target
    assert target.read_text() == "untouched\n"
    assert (target.stat().st_mtime_ns, target.stat().st_size) == (
        before.st_mtime_ns,
        before.st_size,
    )


@needs_nvcc
@pytest.mark.parametrize(
    "name",
    [
        "launcher.log",
        "launcher.lock",
        "launcher.starting",
        "nvcc-stats.json",
        "toolchain-probes.json",
    ],
)
def test_a_planted_link_is_never_written_through(
    shared_base: Path, outside: Path, name: str
) -> None:
    project = Project(shared_base)
    project.cache.mkdir(mode=0o700)
    (project.cache / name).symlink_to(outside)
    project.env["KERNELCACHE_COMPILED_CLIENT"] = "0"
    try:
        assert project.run().returncode == 0  # a miss; it starts a server (unless it refuses)
        # Refusing to start is right for some links: then no server process is left.
        wait_for(
            lambda: listening(project.cache) or not starting_or_running(project.cache),
            60,
            "the server to listen or to give up",
        )
        (project.project / "k.cubin").unlink()
        assert project.run().returncode == 0  # a hit, from the server if one listens
    finally:
        stop_server(project.cache)  # its report goes to the log


def _foreign_elf(path: Path) -> None:
    """An executable for another machine: the kernel refuses it (Exec format error)."""
    machine = 183 if os.uname().machine == "x86_64" else 62  # aarch64, else x86-64
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + (2).to_bytes(2, "little")
    path.write_bytes(header + machine.to_bytes(2, "little") + bytes(200))


@needs_nvcc
@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
@pytest.mark.parametrize("planted", ["foreign-elf", "bad-interpreter"])
def test_a_client_that_cannot_start_here_falls_back_and_is_built_again(
    shared_base: Path, planted: str
) -> None:
    """A same-named machine's client (marked for its own boot) under this machine's name."""
    project = Project(shared_base)
    project.env["KERNELCACHE_COMPILED_CLIENT"] = "1"  # the suite's default is 0
    project.cache.mkdir(mode=0o700)
    path = project.cache / client_name()
    if planted == "foreign-elf":
        _foreign_elf(path)
    else:
        path.write_text("#!/nonexistent/interpreter\n")
    path.chmod(0o1700)
    os.link(path, f"{path}.ok-00000000-0000-0000-0000-000000000000")
    try:
        first = project.run()
        assert first.returncode == 0, first.stderr
        assert b"unused_on_purpose" in first.stderr
        mark = Path(f"{path}.ok-{_proc('random/boot_id')}")
        wait_for(lambda: mark.exists(), 120, "the client to be built again and marked")
        assert os.path.samefile(mark, path)
        assert subprocess.run([str(path), "--protocol"], capture_output=True).returncode == 0
        hit = project.run()
        assert hit.returncode == 0, hit.stderr
    finally:
        stop_server(project.cache)
    assert "does not run on this machine" in (project.cache / "launcher.log").read_text()
    assert answered(project.cache)["compiled hit"] == 1
