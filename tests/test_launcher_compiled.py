"""The compiled launcher client (``client.c``): the Python client's answers, without Python.

Real processes throughout: the ``kernelcache`` front as installed, real
servers, real nvcc, and the client built once per module as the server
builds it (:func:`kernelcache.nvcc.native.build`; one test watches a server
do it). Faults are real (SIGKILL, SIGSTOP); replies no real server sends
come from a fake listener on the socket and reach a build of the client
with the address and undefined-behaviour sanitizers, where gcc has them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache.nvcc import client, native
from launcher_env import (
    CUBIN,
    KERNEL,
    FakeServer,
    Project,
    answered,
    clean_env,
    client_path,
    install_client,
    listening,
    make_bin,
    mark,
    server_pid,
    start_server,
    stats,
    stop_server,
    wait_for,
    without_file_symbol,
)

ROOT = Path(__file__).resolve().parent.parent
COMPILER = next(filter(None, (shutil.which(c) for c in native.COMPILERS)), None)
pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the compiled client is Linux-only"),
    pytest.mark.skipif(COMPILER is None, reason="no C compiler"),
    pytest.mark.skipif(native.platform_tag() is None, reason="no usable host name"),
]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _compile(out: Path, *flags: str) -> Path | None:
    cmd = [str(COMPILER), "-O1", *flags, "-o", str(out), native.SOURCE]
    if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
        return None
    check = subprocess.run([str(out), "--protocol"], capture_output=True, check=False)
    return out if check.returncode == 0 else None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client, built (and self-tested) exactly as a server builds it."""
    where = tmp_path_factory.mktemp("built")
    name = client_path(where).name
    assert native.build(str(where), name, str(COMPILER))
    return where / name


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory, built: Path) -> Path:
    """The client with ASan and UBSan (any finding aborts it); the plain build without them."""
    out = tmp_path_factory.mktemp("asan") / "client"
    flags = ("-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
    return _compile(out, *flags) or built


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Builds that speak another protocol: an older and a newer version's."""
    where = tmp_path_factory.mktemp("variants")
    found = {}
    for version in ("1", "99"):
        define = f'-DKC_PROTOCOL="kernelcache-launcher/{version}"'
        binary = _compile(where / f"client-{version}", define)
        assert binary is not None
        found[version] = binary
    return found


DUPLICATES = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
extern char **environ;
int main(int argc, char **argv) {  /* environ, a second KERNELCACHE_DIR, an entry without "=" */
    int n = 0;
    while (environ[n]) n++;
    char **env = calloc(n + 3, sizeof *env);
    memcpy(env, environ, n * sizeof *env);
    env[n] = "KERNELCACHE_DIR=/nonexistent/second";
    env[n + 1] = "NO_EQUALS_SIGN";
    (void)argc;
    execve(argv[1], argv + 1, env);
    return 127;
}
"""


@pytest.fixture(scope="module")
def duplicates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program that runs its arguments with an environment Python's os.environ cannot hold."""
    where = tmp_path_factory.mktemp("dup")
    (where / "dup.c").write_text(DUPLICATES)
    cmd = [str(COMPILER), "-o", str(where / "dup"), str(where / "dup.c")]
    subprocess.run(cmd, check=True)
    return where / "dup"


class Setup(Project):
    """A user's bin directory, cache (with a client in it) and project."""

    def __init__(self, root: Path, binary: Path | None) -> None:
        super().__init__(root)
        self.cache.mkdir(mode=0o700)
        if binary is not None:
            install_client(self.cache, binary)
        self.cold = b""


@pytest.fixture
def setup(tmp_path: Path, built: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, built)
    yield s
    stop_server(s.cache)


# The client matches this checkout ------------------------------------------------


def test_the_front_names_this_source_and_both_clients_speak_one_protocol(built: Path) -> None:
    source = Path(native.SOURCE).read_bytes()
    expected = f"launcher-client-{native.source_hash(source)}-$m-$o-$l-$h"
    assert expected in (ROOT / "bin" / "kernelcache").read_text(), (
        f"client.c changed: bin/kernelcache must name {expected}"
    )
    define = re.search(rb'#define KC_PROTOCOL "([^"]*)"', source)
    assert define is not None
    assert define.group(1) == client.PROTOCOL
    run = json.dumps(client.RUN_LAUNCHER).encode()
    assert b"#define RUN_LAUNCHER " + run + b"\n" in source
    out = subprocess.run([str(built), "--protocol"], capture_output=True, check=True).stdout
    assert out == client.PROTOCOL + b"\n"
    assert stat.S_IMODE(built.stat().st_mode) == native.MODE == 0o1700


# Same request, same answer as the Python client ------------------------------------


def _dir_case(case: str, tmp: Path, env: dict[str, str]) -> None:
    for name in ("KERNELCACHE_DIR", "XDG_CACHE_HOME"):
        env.pop(name, None)
    env["HOME"] = str(tmp / "home")
    if case in ("absolute", "duplicates"):
        env["KERNELCACHE_DIR"] = str(tmp / "kc")
    elif case == "tilde":
        env["KERNELCACHE_DIR"] = "~/kc"
    elif case == "xdg":
        env["XDG_CACHE_HOME"] = str(tmp / "xdg") + "/"
    elif case == "long":  # longer than sun_path: reached through /proc/self/fd
        env["KERNELCACHE_DIR"] = str(tmp / ("d" * 60) / ("e" * 60))


# A relative KERNELCACHE_DIR is refused (issue 20): the Python client asks no server.
DIR_CASES = ["absolute", "tilde", "xdg", "default", "long", "duplicates"]
HIT = client.pack([b"hit", b"3", bytes(range(256)) * 4 + b"\0end", b"warning: x\n" * 100_000])


@pytest.mark.parametrize("case", DIR_CASES)
@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(HIT, id="hit"),
        pytest.param(client.pack([b"plain", b"FAKE_NVCC"]), id="plain"),
        pytest.param(client.pack([b"plain", b"/nonexistent/nvcc"]), id="plain-missing"),
    ],
)
def test_the_compiled_client_asks_and_answers_as_the_python_client(
    tmp_path: Path, built: Path, duplicates: Path, case: str, reply: bytes
) -> None:
    """Byte for byte the same request (directory, cwd, umask, argv, environment), the same output."""
    front = make_bin(tmp_path / "bin")
    fake_nvcc = tmp_path / "fakebin" / "nvcc"
    fake_nvcc.parent.mkdir()
    fake_nvcc.write_text('#!/bin/sh\necho "fake nvcc: $*"; echo "to stderr" >&2; exit 7\n')
    fake_nvcc.chmod(0o755)
    reply = reply.replace(b"FAKE_NVCC", os.fsencode(fake_nvcc))
    project = tmp_path / "project"
    project.mkdir()
    env = clean_env(tmp_path / "unused", LANG="C.UTF-8")
    _dir_case(case, tmp_path, env)
    directory = client.cache_dir({os.fsencode(k): os.fsencode(v) for k, v in env.items()},
                                 os.fsencode(project))  # fmt: skip
    assert directory is not None
    Path(os.fsdecode(directory)).mkdir(mode=0o700, parents=True)
    fake = FakeServer(Path(os.fsdecode(directory)) / "launcher.sock", reply, count=2)
    # The client runs only as the file of its name in the (trusted) cache directory.
    installed = install_client(Path(os.fsdecode(directory)), built)
    argv = ["nvcc", "-arch=sm_90", "-c", "k.cu", "-o", "k o", "-DX=\xe9"]
    results = []
    prefix = [str(duplicates)] if case == "duplicates" else []
    try:
        for cmd in (
            [sys.executable, "-I", "-S", str(front), *argv],  # what the front runs without it
            [str(installed), sys.executable, str(front), *argv],  # what it runs with it
        ):
            proc = subprocess.run(
                [*prefix, *cmd], cwd=project, env=env, capture_output=True, umask=0o027
            )
            results.append((proc.returncode, proc.stdout, proc.stderr))
    finally:
        fake.close()
    assert fake.compiled == [False, True]
    assert fake.requests[0] == fake.requests[1]
    assert fake.requests[0] is not None
    assert fake.requests[0][2] == directory
    assert results[0] == results[1]
    if reply == HIT:
        assert results[1] == (3, bytes(range(256)) * 4 + b"\0end", b"warning: x\n" * 100_000)


# Which binary the front runs ------------------------------------------------------


def _probe(path: Path, *, mode: int = native.MODE, marked: bool = True) -> Path:
    """A script where the client belongs; when run, it writes its arguments to ``path.ran``."""
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{path}.ran"\necho probed\n')
    path.chmod(mode)
    if marked:
        mark(path)
    return path


@pytest.mark.parametrize("case", ["absolute", "tilde", "xdg", "default"])
def test_the_front_finds_the_client_where_the_client_finds_the_cache(
    tmp_path: Path, case: str
) -> None:
    front = make_bin(tmp_path / "bin")
    env = clean_env(tmp_path / "unused")
    _dir_case(case, tmp_path, env)
    directory = client.cache_dir({os.fsencode(k): os.fsencode(v) for k, v in env.items()}, b"/")
    assert directory is not None
    cache = Path(os.fsdecode(directory))
    cache.mkdir(mode=0o700, parents=True)
    probe = _probe(client_path(cache))
    proc = subprocess.run([str(front), "nvcc", "-c", "k.cu"], env=env, capture_output=True)
    assert proc.stdout == b"probed\n"
    ran = Path(f"{probe}.ran").read_text().splitlines()
    assert ran == [sys.executable, str(front), "nvcc", "-c", "k.cu"]


def _plant(cache: Path, how: str) -> Path:
    """A probe where a careless front might run it; returns the probe."""
    expected = client_path(cache)
    if how == "symlink":  # to a program of this user's that no server built (no sticky bit)
        target = _probe(cache / "elsewhere", mode=0o700, marked=False)
        expected.symlink_to(target)
        mark(expected)
        return target
    if how == "stale-hash":
        return _probe(
            cache / re.sub(r"client-[0-9a-f]{16}", "client-0123456789abcdef", expected.name)
        )
    if how == "other-host":
        return _probe(cache / (expected.name.rsplit("-", 1)[0] + "-otherhost"))
    if how == "other-machine":
        machine = expected.name.split("-")[3]
        other = "aarch64" if machine != "aarch64" else "x86_64"
        return _probe(cache / expected.name.replace(f"-{machine}-", f"-{other}-", 1))
    if how == "not-marked":
        return _probe(expected, marked=False)
    if how == "marked-for-another-boot":
        probe = _probe(expected, marked=False)
        mark(probe, "00000000-0000-0000-0000-000000000000")
        return probe
    if how == "replaced-after-its-mark":
        _probe(expected)
        replacement = _probe(cache / "replacement", marked=False)
        replacement.rename(expected)
        return expected
    probe = _probe(expected, mode=0o700 if how == "not-sticky" else native.MODE)
    if how == "not-executable":
        probe.chmod(0o1600)
    elif how == "other-owner":
        os.chown(probe, 12345, 12345)
    return probe


@pytest.mark.parametrize(
    "how",
    [
        "symlink",
        "stale-hash",
        "other-host",
        "other-machine",
        "not-marked",
        "marked-for-another-boot",
        "replaced-after-its-mark",
        "not-sticky",
        "not-executable",
        pytest.param(
            "other-owner",
            marks=pytest.mark.skipif(os.getuid() != 0, reason="needs root to give it away"),
        ),
    ],
)
def test_a_planted_binary_is_never_run(tmp_path: Path, how: str) -> None:
    front = make_bin(tmp_path / "bin")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    probe = _plant(cache, how)
    fake_nvcc = tmp_path / "fakebin" / "nvcc"
    fake_nvcc.parent.mkdir()
    fake_nvcc.write_text('#!/bin/sh\necho "fake nvcc: $*"\n')
    fake_nvcc.chmod(0o755)
    env = clean_env(cache, KERNELCACHE_SERVER="0")
    proc = subprocess.run([str(front), str(fake_nvcc), "--version"], env=env, capture_output=True)
    assert (proc.returncode, proc.stdout) == (0, b"fake nvcc: --version\n"), proc.stderr
    assert not Path(f"{probe}.ran").exists()


def test_the_front_leaves_a_callers_descriptor_9_alone(tmp_path: Path) -> None:
    """The client is run through fd 9: never when the caller passed one (a jobserver's pipe)."""
    front = make_bin(tmp_path / "bin")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    probe = _probe(client_path(cache))
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text('#!/bin/sh\necho "fake nvcc: $*"\n')
    fake_nvcc.chmod(0o755)
    env = clean_env(cache, KERNELCACHE_SERVER="0")
    (tmp_path / "passed").write_text("the caller's\n")
    opened = 'exec "$0" "$@" 9<"$PASSED"'  # what make does with its jobserver's descriptors
    env["PASSED"] = str(tmp_path / "passed")
    cmd = ["/bin/sh", "-c", opened, str(front), str(fake_nvcc), "--version"]
    proc = subprocess.run(cmd, env=env, capture_output=True)
    assert (proc.returncode, proc.stdout) == (0, b"fake nvcc: --version\n"), proc.stderr
    assert not Path(f"{probe}.ran").exists()


# Hits, plain runs and failures, through a real server -------------------------------


#: A build directory's own modules named as kernelcache's and the standard library's:
#: run, each would leave a mark and make the call fail.
SHADOWS = ("kernelcache.py", "json.py", "logging.py")
_SHADOW = 'open(__file__ + ".ran", "w").close()\nraise SystemExit(3)\n'


@needs_nvcc
@pytest.mark.parametrize("client", ["python", "compiled"])
def test_a_build_directorys_own_modules_never_run(tmp_path: Path, built: Path, client: str) -> None:
    """``python -m`` puts the current directory first on ``sys.path``: a project's own
    ``kernelcache.py`` ran in place of the launcher, and every nvcc call failed. The
    launcher (from either client) and the server it starts run without it."""
    s = Setup(tmp_path, built if client == "compiled" else None)
    for name in SHADOWS:
        (s.project / name).write_text(_SHADOW)
    try:
        first = s.run()  # no server: the launcher runs, and starts one from this directory
        assert first.returncode == 0, first.stderr
        wait_for(lambda: listening(s.cache), 60, "the server started by the launcher")
        (s.project / "k.cu").write_text(KERNEL.replace("a *", "2.0f * a *"))
        other = s.run()  # the server's miss: the launcher again, from the client
        assert other.returncode == 0, other.stderr
        (s.project / "k.cu").write_text(KERNEL)
        hit = s.run()
        assert (hit.returncode, hit.stderr) == (0, first.stderr)
    finally:
        stop_server(s.cache)
    assert not list(s.project.glob("*.ran"))
    assert stats(s.cache)["server_hits"] == 1
    assert answered(s.cache)[f"{client} fallback"] >= 1  # the miss the client handed over


@needs_nvcc
def test_compiled_client_hits_are_what_nvcc_gave(setup: Setup) -> None:
    (setup.project / "bad.cu").write_text("__global__ void k() { not_declared(); }\n")
    (setup.project / "out").mkdir()
    obj = ["-arch=sm_90", "-c", "k.cu", "-o", "out/k.o", "-MD", "-MF", "out/k.o.d"]
    bad = ["-arch=sm_90", "-cubin", "bad.cu", "-o", "bad.cubin"]
    plain = {}
    for name, args in (("obj", obj), ("cubin", CUBIN), ("bad", bad), ("version", ["--version"])):
        proc = subprocess.run(["nvcc", *args], cwd=setup.project, capture_output=True)
        outputs = [setup.project / p for p in ("out/k.o", "out/k.o.d", "k.cubin")]
        plain[name] = (proc, {p: p.read_bytes() for p in outputs if p.exists()})
        for p in outputs:
            p.unlink(missing_ok=True)
    # No server yet: the compiled client hands over to the Python client; the launcher starts one.
    miss = setup.run(obj)
    assert miss.returncode == 0
    assert stats(setup.cache)["misses"] == 1
    assert miss.stderr == plain["obj"][0].stderr
    start_server(setup.cache, setup.env)
    assert setup.run().returncode == 0  # the CUBIN miss
    for _ in range(2):
        for name, args in (("obj", obj), ("cubin", CUBIN)):
            for path in plain[name][1]:
                path.unlink(missing_ok=True)
            hit = setup.run(args)
            want = plain[name][0]
            assert (hit.returncode, hit.stdout, hit.stderr) == (0, want.stdout, want.stderr)
            assert b"unused_on_purpose" in hit.stderr
            for path, data in plain[name][1].items():
                got = path.read_bytes()
                if path.suffix == ".o":
                    got, data = without_file_symbol(got), without_file_symbol(data)
                assert got == data, path
    for name, args in (("bad", bad), ("version", ["--version"])):
        proc, want = setup.run(args), plain[name][0]
        assert (proc.returncode, proc.stdout, proc.stderr) == (
            want.returncode,
            want.stdout,
            want.stderr,
        )
    assert plain["bad"][0].returncode != 0
    assert stats(setup.cache) == {**stats(setup.cache), "hits": 4, "server_hits": 4, "failed": 1}
    stop_server(setup.cache)
    report = answered(setup.cache)
    assert report["compiled hit"] == 4
    assert report["python hit"] == 0
    assert report["compiled plain"] == 1  # --version: uncacheable, nvcc run by the client
    assert report["compiled fallback"] == 2  # the CUBIN miss and the failed compile


def _same_cubin(s: Setup, proc: subprocess.CompletedProcess[bytes], cold: bytes) -> None:
    assert proc.returncode == 0, proc.stderr
    assert b"unused_on_purpose" in proc.stderr, proc.stderr
    assert (s.project / "k.cubin").read_bytes() == cold


@needs_nvcc
def test_a_killed_server_is_replaced_by_way_of_the_python_client(setup: Setup) -> None:
    setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    pid = server_pid(setup.cache)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: server_pid(setup.cache) is None, 60, "the killed server to go")
    (setup.project / "k.cubin").unlink()
    _same_cubin(setup, setup.run(), cold)
    wait_for(lambda: server_pid(setup.cache) not in (None, pid), 60, "a new server")
    wait_for(lambda: listening(setup.cache), 60, "it to listen")  # not the killed one's file
    _same_cubin(setup, setup.run(), cold)
    stop_server(setup.cache)
    assert answered(setup.cache)["compiled hit"] == 1


@needs_nvcc
def test_a_stopped_server_costs_its_timeout_not_the_build(setup: Setup) -> None:
    setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    pid = server_pid(setup.cache)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        (setup.project / "k.cubin").unlink()
        _same_cubin(setup, setup.run(KERNELCACHE_SERVER_TIMEOUT="1"), cold)
        # Counted while the server is still stopped: once resumed, it answers the requests
        # left in its backlog (the client's, the fallback's plan) to callers long gone.
        assert stats(setup.cache)["hits"] == 1
        assert stats(setup.cache)["server_hits"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)


@needs_nvcc
def test_server_off_or_read_only_means_no_request(setup: Setup) -> None:
    setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    for value in ("0", " Off "):
        _same_cubin(setup, setup.run(KERNELCACHE_SERVER=value), cold)
    assert stats(setup.cache)["hits"] == 2
    _same_cubin(setup, setup.run(KERNELCACHE_READONLY="yes"), cold)
    stop_server(setup.cache)
    assert not answered(setup.cache)


@needs_nvcc
def test_an_older_client_leaves_the_server_and_asks_through_python(
    setup: Setup, variants: dict[str, Path]
) -> None:
    """A stale client speaking protocol 1: answered, the server stays, hits come through Python."""
    install_client(setup.cache, variants["1"])
    setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    pid = server_pid(setup.cache)
    for _ in range(3):
        _same_cubin(setup, setup.run(), cold)
    assert server_pid(setup.cache) == pid
    assert stats(setup.cache)["server_hits"] == 3
    stop_server(setup.cache)
    report = answered(setup.cache)
    assert report["compiled fallback"] == 3
    assert report["python hit"] == 3


@needs_nvcc
def test_a_newer_client_makes_way_for_its_own_server(
    setup: Setup, variants: dict[str, Path]
) -> None:
    install_client(setup.cache, variants["99"])
    setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    pid = server_pid(setup.cache)
    _same_cubin(setup, setup.run(), cold)
    wait_for(lambda: server_pid(setup.cache) != pid, 60, "the older server to exit")


# Replies no real server sends --------------------------------------------------------


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory, sanitized: Path) -> Iterator[Setup]:
    """One compiled result, and the sanitized client: every odd reply must end in a local hit."""
    s = Setup(tmp_path_factory.mktemp("odd"), sanitized)
    s.env["KERNELCACHE_SERVER_TIMEOUT"] = "30"
    if shutil.which("nvcc"):
        # No server: one the miss started would bind its socket whenever it gets there,
        # over a test's fake listener if that is bound by then.
        assert s.run(KERNELCACHE_SERVER="0").returncode == 0
        s.cold = (s.project / "k.cubin").read_bytes()
    yield s
    stop_server(s.cache)


def _body(*items: bytes) -> bytes:
    return client.pack(list(items))[8:]


def _len(n: int) -> bytes:
    return n.to_bytes(4, "big")


def _message(body: bytes, size: int | None = None) -> bytes:
    return (len(body) if size is None else size).to_bytes(8, "big") + body


ODD_REPLIES = {
    "hang-up": b"",
    "short-length": b"\0\0\0",
    "truncated": client.pack([b"hit", b"0", b"", b"x" * 100])[:-40],
    "huge-announced": _message(b"", 1 << 63),
    "larger-than-allowed": _message(b"abc", (1 << 30) + 1),
    "item-past-the-end": _message(b"\xff\xff\xff\xffhit"),
    "stderr-past-the-end": _message(_body(b"hit", b"0", b"") + _len(1000) + b"abc"),
    "path-past-the-end": _message(_body(b"plain") + _len(1000) + b"/bin/true"),
    "item-length-cut": _message(_body(b"hit", b"0", b"", b"") + b"\0\0"),
    "status-not-a-number": client.pack([b"hit", b"x", b"", b""]),
    "status-negative": client.pack([b"hit", b"-1", b"", b""]),
    "status-too-large": client.pack([b"hit", b"256", b"", b""]),
    "hit-with-five-items": client.pack([b"hit", b"0", b"", b"", b""]),
    "plain-without-path": client.pack([b"plain"]),
    "plain-empty-path": client.pack([b"plain", b""]),
    "plain-path-with-nul": client.pack([b"plain", b"/bin/true\0x"]),
    "fallback-miss": client.pack([b"fallback", b"miss"]),
    "unknown-answer": client.pack([b"something else"]),
    "empty-message": client.pack([]),
}


@needs_nvcc
@pytest.mark.parametrize("name", list(ODD_REPLIES))
def test_an_odd_reply_ends_in_a_correct_local_compile(warm_cache: Setup, name: str) -> None:
    s = warm_cache
    (s.cache / "launcher.sock").unlink(missing_ok=True)
    fake = FakeServer(s.cache / "launcher.sock", ODD_REPLIES[name])
    before = stats(s.cache)["hits"]
    try:
        (s.project / "k.cubin").unlink(missing_ok=True)
        proc = s.run()
    finally:
        fake.close()
    assert b"Sanitizer" not in proc.stderr, proc.stderr
    assert b"runtime error" not in proc.stderr, proc.stderr
    _same_cubin(s, proc, s.cold)
    assert fake.compiled == [True]
    assert stats(s.cache)["hits"] == before + 1
    assert stats(s.cache)["server_hits"] == 0


# The server builds it ---------------------------------------------------------------


def test_the_server_builds_the_client_in_the_background(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = clean_env(cache, **{native.ENV: "1"})
    start_server(cache, env)
    try:
        wait_for(lambda: client_path(cache).exists(), 120, "the client to be built")
    finally:
        stop_server(cache)
    st = os.lstat(client_path(cache))
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o1700
    assert st.st_uid == os.getuid()
    assert "kernelcache server: built " in (cache / "launcher.log").read_text()
    assert _counter(cache, "compiled_client_built") == 1
    assert not [p for p in cache.iterdir() if ".tmp." in p.name]


def _counter(cache: Path, name: str) -> int:
    import json

    return int(json.loads((cache / "nvcc-stats.json").read_bytes()).get(name, 0))


def _broken_compiler(where: Path) -> Path:
    where.mkdir()
    cc = where / "cc"
    cc.write_text(f'#!/bin/sh\necho "$*" >> {where}/calls\necho "cc: broken on purpose"\nexit 1\n')
    cc.chmod(0o755)
    return where


def test_a_failed_build_is_logged_counted_and_not_retried(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fake = _broken_compiler(tmp_path / "fakecc")
    env = clean_env(cache, **{native.ENV: "1"})
    env["PATH"] = f"{fake}:{env['PATH']}"
    log = cache / "launcher.log"
    for expected in ("could not build", "not built again"):
        start_server(cache, env)
        wait_for(lambda: expected in log.read_text(), 120, expected)  # noqa: B023
        stop_server(cache)
    calls = (fake / "calls").read_text().splitlines()
    assert len(calls) == len(native.FLAG_SETS)  # one attempt, each way of linking
    note = client_path(cache).with_name(client_path(cache).name + ".failed")
    assert "cc: broken on purpose" in note.read_text()
    assert _counter(cache, "compiled_client_failed") == 1
    assert not client_path(cache).exists()


def test_without_a_compiler_the_server_builds_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = clean_env(cache, **{native.ENV: "1"})
    env["PATH"] = str(tmp_path / "nothing-here")
    start_server(cache, env)
    log = cache / "launcher.log"
    wait_for(lambda: "no C compiler" in log.read_text(), 120, "the server to look for one")
    stop_server(cache)
    assert not [p for p in cache.iterdir() if p.name.startswith(native.PREFIX)]
    assert not (cache / "nvcc-stats.json").exists()


# The build's decisions, in this process ----------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"node-1.example\n", "node-1.example"), (b"a/b\n", None), (b"\n", None), (b"\xe9\n", None)],
)
def test_host_name(tmp_path: Path, content: bytes, expected: str | None) -> None:
    (tmp_path / "hostname").write_bytes(content)
    assert native.host_name(str(tmp_path / "hostname")) == expected
    assert native.host_name(str(tmp_path / "missing")) is None


def test_prune_keeps_what_is_in_use(tmp_path: Path) -> None:
    now = 1e9
    keep = "launcher-client-aaaaaaaaaaaaaaaa-here"
    ages = {
        keep: 1e8,  # ours: refreshed, never removed
        "launcher-client-bbbbbbbbbbbbbbbb-here": native.STALE_SECONDS + 10,
        "launcher-client-aaaaaaaaaaaaaaaa-there": native.STALE_SECONDS - 10,
        "launcher-client-aaaaaaaaaaaaaaaa-here.tmp.1": native.TEMP_SECONDS + 10,
        "launcher-client-aaaaaaaaaaaaaaaa-here.tmp.2": native.TEMP_SECONDS - 10,
        "nvcc-stats.json": 1e8,
    }
    for name, age in ages.items():
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (now - age, now - age))
    os.link(tmp_path / keep, tmp_path / f"{keep}.ok-this-boot")  # a mark of keep: kept
    (tmp_path / "old").write_text("")  # keep was built again since this mark: removed at once
    os.link(tmp_path / "old", tmp_path / f"{keep}.ok-other-boot")
    (tmp_path / "old").unlink()
    native.prune(str(tmp_path), keep, now)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            keep,
            f"{keep}.ok-this-boot",
            "launcher-client-aaaaaaaaaaaaaaaa-there",
            f"{keep}.tmp.2",
            "nvcc-stats.json",
        ]
    )
    assert (tmp_path / keep).stat().st_mtime > now


def test_start_builds_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _broken_compiler(tmp_path / "fakecc")
    monkeypatch.setenv("PATH", str(fake))
    cache = tmp_path / "cache"
    cache.mkdir()
    assert native.start(str(cache), {native.ENV: "off"}) is None
    client_path(cache).write_text("")
    marked = mark(client_path(cache))
    assert native.start(str(cache), {}) is None  # ran here since this boot: nothing to do
    marked.unlink()
    thread = native.start(str(cache), {})  # not known to run here: checked, removed, rebuilt
    assert thread is not None
    thread.join()
    assert not client_path(cache).exists()
    assert _counter(cache, "compiled_client_failed") == 1
    assert native.start(str(cache), {}) is None  # the failure is remembered
    assert len((fake / "calls").read_text().splitlines()) == len(native.FLAG_SETS)
    monkeypatch.setattr(native, "platform_tag", lambda: None)
    assert native.start(str(cache), {}) is None


def test_the_client_is_built_once_per_user_not_per_cache_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh CI runner's empty cache directory takes the client built for this user, a
    hard link to the same checked file: no compile on its first build (issue 40)."""
    cc = tmp_path / "bin" / "cc"
    cc.parent.mkdir()
    cc.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\nexec {COMPILER} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{cc.parent}:{os.environ['PATH']}")
    env = {native.SHARED_ENV: str(tmp_path / "clients")}
    caches = [tmp_path / "cache-a", tmp_path / "cache-b"]
    for cache in caches:
        cache.mkdir()
        thread = native.start(str(cache), env)
        assert thread is not None
        thread.join()
        assert native.marked(str(cache), client_path(cache).name, native.boot_id() or "")
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert _counter(caches[0], "compiled_client_built") == 1
    assert not (caches[1] / "nvcc-stats.json").exists()  # nothing built, nothing failed
    shared = tmp_path / "clients" / client_path(caches[0]).name
    assert client_path(caches[1]).stat().st_ino == shared.stat().st_ino
    assert stat.S_IMODE(shared.stat().st_mode) == native.MODE & 0o7777
    assert native.start(str(caches[1]), env) is None  # marked here: nothing to do


def test_an_untrusted_shared_folder_is_not_used(tmp_path: Path) -> None:
    shared = tmp_path / "open"
    shared.mkdir()
    shared.chmod(0o777)
    assert native.shared_dir({native.SHARED_ENV: str(shared)}) is None
    assert native.shared_dir({}) is None
    assert native.shared_dir({"HOME": str(tmp_path)}) == str(
        tmp_path / ".cache/kernelcache-clients"
    )


@pytest.mark.parametrize(
    ("script", "built", "step_timeout"),
    [
        pytest.param(
            'case "$*" in *-static*) exit 1 ;; esac\n{write}', True, 60.0, id="dynamic-only"
        ),
        pytest.param("{write}", False, 60.0, id="another-protocol"),
        pytest.param("sleep 5", False, 2.0, id="hangs"),
    ],
)
def test_build_checks_what_it_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, built: bool, step_timeout: float
) -> None:
    """The binary must run here and speak this protocol before it gets its name.

    Only the compiler that hangs meets a short step limit: the others' steps run
    under ``nice -n 19`` (native._NICE), and on a loaded machine one took over 2 s.
    """
    monkeypatch.setattr(native, "STEP_TIMEOUT", step_timeout)
    protocol = client.PROTOCOL.decode() if built else "kernelcache-launcher/0"
    write = 'while [ "$1" != -o ]; do shift; done\nprintf "#!/bin/sh\\necho PROTO\\n" > "$2"\nchmod +x "$2"'
    write = write.replace("PROTO", protocol)
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n" + script.replace("{write}", write) + "\n")
    cc.chmod(0o755)
    name = client_path(tmp_path).name
    assert native.build(str(tmp_path), name, str(cc)) is built
    assert (tmp_path / name).exists() is built
    assert (tmp_path / f"{name}.failed").exists() is not built
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]
