"""The launcher's server and client: private, self-starting, self-stopping, never needed.

Real processes throughout: the installed ``kernelcache`` executable, a real
server, real nvcc. Faults are real too (SIGKILL, SIGSTOP, a foreign socket
owner); only "a server that dies in the middle of a request" is played by a
small listener that reads the request and hangs up, because a real server
cannot be killed at exactly that instant on demand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache.nvcc import client, control, front
from launcher_env import (
    CUBIN,
    FakeServer,
    Project,
    clean_env,
    listening,
    server_pid,
    start_server,
    stats,
    stop_server,
    wait_for,
)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Project]:
    s = Project(tmp_path)
    time.sleep(0.05)
    yield s
    stop_server(s.cache)


def test_hit_from_the_server_is_what_nvcc_gave(setup: Project) -> None:
    miss = setup.warm()
    cold = (setup.project / "k.cubin").read_bytes()
    (setup.project / "k.cubin").unlink()
    hit = setup.run()
    assert (hit.returncode, hit.stdout, hit.stderr) == (0, miss.stdout, miss.stderr)
    assert b"unused_on_purpose" in hit.stderr
    assert (setup.project / "k.cubin").read_bytes() == cold
    assert stats(setup.cache)["server_hits"] == 1


def test_socket_and_log_are_private(setup: Project) -> None:
    setup.warm()
    for name in ("launcher.sock", "launcher.log", "launcher.lock"):
        mode = os.lstat(setup.cache / name).st_mode
        assert stat.S_IMODE(mode) == 0o600, name
    assert stat.S_ISSOCK(os.lstat(setup.cache / "launcher.sock").st_mode)


def test_a_missing_server_is_started_for_the_next_call(setup: Project) -> None:
    assert setup.run().returncode == 0  # a miss, in-process, and a server started for later
    wait_for(lambda: listening(setup.cache), 60, "the server to listen")
    assert setup.run().returncode == 0
    assert stats(setup.cache) == {**stats(setup.cache), "misses": 1, "hits": 1, "server_hits": 1}


def test_server_off(setup: Project) -> None:
    for _ in range(3):
        assert setup.run(KERNELCACHE_SERVER="0").returncode == 0
    assert server_pid(setup.cache) is None
    assert stats(setup.cache)["hits"] == 2


def test_idle_server_exits_by_itself(setup: Project) -> None:
    """Seen by its log, not by catching it alive: a server idle for 1 s may be gone
    before a test on a loaded machine looks for its pid."""
    setup.env["KERNELCACHE_SERVER_IDLE"] = "1"
    assert setup.run().returncode == 0  # a miss: it starts a server for the next call
    log = setup.cache / "launcher.log"
    exited = "kernelcache server: exiting: idle"
    wait_for(lambda: log.exists() and exited in log.read_text(), 60, "the idle server to exit")
    wait_for(lambda: server_pid(setup.cache) is None, 60, "its lock to be released")
    assert not (setup.cache / "launcher.sock").exists()


def test_crashed_server_is_replaced(setup: Project) -> None:
    setup.warm()
    pid = server_pid(setup.cache)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: server_pid(setup.cache) is None, 60, "the killed server to go")
    assert (setup.cache / "launcher.sock").exists()  # stale: nobody listens
    after_crash = setup.run()
    assert after_crash.returncode == 0
    assert b"unused_on_purpose" in after_crash.stderr
    wait_for(lambda: server_pid(setup.cache) not in (None, pid), 60, "a new server")
    wait_for(lambda: not (setup.cache / "launcher.starting").exists(), 60, "it to listen")
    before = stats(setup.cache)["server_hits"]
    assert setup.run().returncode == 0
    assert stats(setup.cache)["server_hits"] == before + 1


def test_a_hung_server_costs_its_timeout_not_the_build(setup: Project) -> None:
    setup.warm()
    pid = server_pid(setup.cache)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        (setup.project / "k.cubin").unlink()
        proc = setup.run(KERNELCACHE_SERVER_TIMEOUT="1")
        assert proc.returncode == 0
        assert (setup.project / "k.cubin").stat().st_size > 100
        assert stats(setup.cache)["server_hits"] == 0
        assert stats(setup.cache)["hits"] == 1
        # A stop that gives up says what the server is doing (here: stopped, "T").
        with pytest.raises(TimeoutError, match=rf"\(pid {pid}\) did not exit in 0.5 s \(state: T"):
            control.stop(str(setup.cache), 0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The SIGTERM it was sent ends it once it runs again.
    wait_for(lambda: server_pid(setup.cache) is None, 60, "the stopped server to exit")


#: A real server (``server.main``) that gets SIGTERM inside a finalizer, as one can
#: while it answers: Python runs the handler there, and drops its SystemExit.
DROPPED_SIGTERM = """
import os, signal, sys
from kernelcache.nvcc import server

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in here
        for _ in range(2):
            pass

serve = server.Server.run

def run(self):
    Finalized()
    return serve(self)

server.Server.run = run
sys.exit(server.main(sys.argv[1:]))
"""


def test_a_sigterm_whose_exit_a_finalizer_dropped_still_stops_the_server(tmp_path: Path) -> None:
    """Issue 40: a server resumed after SIGSTOP and stopped at once served on until idle."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = {**clean_env(cache), "KERNELCACHE_SERVER_IDLE": "30"}
    proc = subprocess.run(
        [sys.executable, "-c", DROPPED_SIGTERM, str(cache)], env=env, timeout=300, check=False
    )
    assert proc.returncode == 0
    log = (cache / "launcher.log").read_text()
    assert "Exception ignored in" in log, log  # the handler's SystemExit, dropped there
    assert "SystemExit" in log, log
    assert "kernelcache server: exiting: SIGTERM" in log, log  # not "idle", 30 s later
    assert not listening(cache)


#: A server as it starts: it holds the lock while the file still names the server before
#: it (a pid no process can have), then empties it and writes its own pid a moment later.
STARTING_SERVER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"4194305 60.0\\n")
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(1.0)
os.ftruncate(fd, 0)
time.sleep(0.5)
os.pwrite(fd, b"%d 60.0\\n" % os.getpid(), 0)
time.sleep(300)
"""


def test_a_stop_as_the_server_starts_waits_for_its_pid(tmp_path: Path) -> None:
    """stop() right after a launcher call started a server (a test's teardown) found the
    lock held and the pid not written yet: it failed on the empty file, or signalled the
    previous server's pid and waited for the lock until its timeout."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    argv = [sys.executable, "-c", STARTING_SERVER, str(cache / control.LOCK)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "locked\n"
            assert control.stop(str(cache), 60) is True
            assert holder.wait(timeout=60) == -signal.SIGTERM
        finally:
            holder.kill()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"", id="hang-up"),
        pytest.param(client.pack([b"hit", b"0", b"", b"x" * 100])[:-40], id="truncated-reply"),
        pytest.param(client.pack([b"something else"]), id="unknown-answer"),
    ],
)
def test_a_server_that_dies_mid_request_is_not_trusted(setup: Project, reply: bytes) -> None:
    assert setup.run(KERNELCACHE_SERVER="0").returncode == 0  # a cached result, no server
    fake = FakeServer(setup.cache / "launcher.sock", reply)
    try:
        (setup.project / "k.cubin").unlink()
        proc = setup.run(KERNELCACHE_SERVER_TIMEOUT="30")
    finally:
        fake.close()
    assert proc.returncode == 0
    assert b"unused_on_purpose" in proc.stderr
    assert (setup.project / "k.cubin").stat().st_size > 100
    assert stats(setup.cache)["hits"] == 1
    assert stats(setup.cache)["server_hits"] == 0


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the socket away")
def test_a_socket_owned_by_someone_else_is_never_used(setup: Project) -> None:
    setup.warm()
    os.chown(setup.cache / "launcher.sock", 12345, -1, follow_symlinks=False)
    assert setup.run().returncode == 0
    assert stats(setup.cache)["server_hits"] == 0
    assert stats(setup.cache)["hits"] == 1


def test_failed_compiles_pass_through_the_executable(setup: Project) -> None:
    (setup.project / "bad.cu").write_text("__global__ void k() { not_declared(); }\n")
    time.sleep(0.05)
    start_server(setup.cache, setup.env)
    args = ["-arch=sm_90", "-cubin", "bad.cu", "-o", "bad.cubin"]
    plain = subprocess.run(["nvcc", *args], cwd=setup.project, capture_output=True, check=False)
    for _ in range(2):
        proc = setup.run(args)
        assert proc.returncode == plain.returncode != 0
        assert proc.stderr == plain.stderr
    assert stats(setup.cache)["failed"] == 2
    assert stats(setup.cache)["hits"] == 0


def test_uncacheable_calls_run_nvcc_and_are_counted_once(setup: Project) -> None:
    setup.warm()
    proc = setup.run(["--version"])
    assert proc.returncode == 0
    assert b"Cuda compilation tools" in proc.stdout
    report = json.loads((setup.cache / "nvcc-stats.json").read_bytes())
    assert report["uncacheable"] == 1
    assert report["reasons"] == {"--version": 1}


def _ask_items(cache: Path, items: list[bytes]) -> list[bytes] | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(cache / "launcher.sock"))
    sock.settimeout(60)
    sock.sendall(client.pack(items))
    try:
        return client.receive(sock)
    finally:
        sock.close()


def _ask_with(cache: Path, protocol: bytes) -> list[bytes] | None:
    return _ask_items(cache, [protocol, b"/", b"/", b"18", b"0"])


def test_a_newer_protocol_makes_the_server_exit(setup: Project) -> None:
    """A client of a later version gets its own server: this one makes way."""
    setup.warm()
    assert _ask_with(setup.cache, b"kernelcache-launcher/99") == [b"fallback", b"protocol"]
    wait_for(lambda: server_pid(setup.cache) is None, 60, "the server to exit")


@pytest.mark.parametrize("protocol", [b"kernelcache-launcher/1", b"kernelcache-launcher/x", b"?"])
def test_an_older_or_unknown_protocol_leaves_the_server_running(
    setup: Project, protocol: bytes
) -> None:
    """Two versions sharing a directory must not make servers exit in turn."""
    setup.warm()
    pid = server_pid(setup.cache)
    for _ in range(2):
        assert _ask_with(setup.cache, protocol) == [b"fallback", b"protocol"]
    assert setup.run().returncode == 0
    assert server_pid(setup.cache) == pid
    assert stats(setup.cache)["server_hits"] == 1


def test_server_hits_are_in_the_cache_statistics(setup: Project) -> None:
    setup.warm()
    for _ in range(3):
        assert setup.run().returncode == 0
    stop_server(setup.cache)  # a stopping server flushes what it counted
    cmd = [sys.executable, "-m", "kernelcache", "--dir", str(setup.cache), "stats", "--json"]
    report = json.loads(subprocess.run(cmd, capture_output=True, check=True).stdout)
    # Each hit reads the manifest and the result from the disk tier.
    assert report["period"]["tiers"]["disk"]["hits"] >= 6, report
    assert report["nvcc_launcher"]["server_hits"] == 3


@pytest.mark.parametrize(
    "items",
    [[], [b""], [b"a", b"", b"\0\xff" * 1000], [bytes(range(256))] * 3],
    ids=["none", "empty", "binary", "all-bytes"],
)
def test_messages_round_trip(items: list[bytes]) -> None:
    message = client.pack(items)
    assert int.from_bytes(message[:8], "big") == len(message) - 8
    assert client.unpack(message[8:]) == items


def test_a_malformed_message_is_refused() -> None:
    with pytest.raises(ValueError, match="truncated"):
        client.unpack(client.pack([b"abcdef"])[8:-2])


def test_bad_requests_cost_the_server_nothing(setup: Project) -> None:
    setup.warm()
    for payload in (
        (1 << 40).to_bytes(8, "big"),  # announces a terabyte
        (5).to_bytes(8, "big") + b"abc",  # ends early
        client.pack([client.PROTOCOL, b"/", b"/", b"18", b"not a count"]),
    ):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(setup.cache / "launcher.sock"))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(60)
        assert sock.recv(65536) in (b"", client.pack([b"fallback", b"malformed"]))
        sock.close()
    assert setup.run().returncode == 0
    assert stats(setup.cache)["server_hits"] == 1


def test_an_importing_process_uses_the_server_too(
    setup: Project, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """``python -m kernelcache nvcc`` and ``kernelcache-cli nvcc`` run the client in-process."""
    monkeypatch.chdir(setup.project)
    for name, value in setup.env.items():
        monkeypatch.setenv(name, value)
    # No server to ask: the launcher runs here and starts one for the next call.
    assert front.main(["nvcc", *CUBIN]) == 0
    assert stats(setup.cache)["misses"] == 1
    wait_for(lambda: listening(setup.cache), 60, "the server to listen")
    wait_for(lambda: not (setup.cache / "launcher.starting").exists(), 60, "its start to end")
    capfd.readouterr()
    assert front.main(["nvcc", *CUBIN]) == 0
    assert b"unused_on_purpose" in capfd.readouterr().err.encode()
    assert stats(setup.cache)["server_hits"] == 1
    # Uncacheable: counted by the server, run here.
    assert front.main(["nvcc", "--version"]) == 0
    assert "Cuda compilation tools" in capfd.readouterr().out
    assert stats(setup.cache)["uncacheable"] == 1
    monkeypatch.setenv("KERNELCACHE_SERVER", "off")
    assert front.main(["nvcc", *CUBIN]) == 0
    assert stats(setup.cache)["server_hits"] == 1
    assert stats(setup.cache)["hits"] == 2


def test_outputs_written_by_the_server_get_the_callers_umask(setup: Project) -> None:
    setup.warm()
    for umask in (0o022, 0o077):
        (setup.project / "k.cubin").unlink()
        proc = subprocess.run(
            [
                "/bin/sh",
                "-c",
                f'umask {umask:o}; exec "$@"',
                "sh",
                str(setup.front),
                "nvcc",
                *CUBIN,
            ],
            cwd=setup.project,
            env=setup.env,
            capture_output=True,
            check=True,
        )
        assert proc.returncode == 0
        assert stat.S_IMODE((setup.project / "k.cubin").stat().st_mode) == 0o666 & ~umask
    assert stats(setup.cache)["server_hits"] == 2


@pytest.mark.parametrize("variable", ["INCLUDES", "PTXAS_FLAGS", "SYSTEM_INCLUDES"])
def test_the_server_keys_what_nvcc_profile_reads(setup: Project, variable: str) -> None:
    """Issue 19: the server's memoised nvcc identity carries the profile's variables."""
    value = "-O0" if variable == "PTXAS_FLAGS" else "-DEXTRA=1"
    # Plain nvcc first: run between the server's calls, a slow compile on a loaded
    # machine would leave it idle for longer than it waits (launcher_env.clean_env).
    fresh = subprocess.run(
        ["nvcc", *CUBIN[:-1], "fresh.cubin"],
        cwd=setup.project,
        env={**setup.env, variable: value},
        check=True,
    )
    assert fresh.returncode == 0
    setup.warm()
    changed = setup.run(CUBIN, **{variable: value})
    assert changed.returncode == 0, changed.stderr
    assert stats(setup.cache)["misses"] == 2
    cached = (setup.project / "k.cubin").read_bytes()
    assert cached == (setup.project / "fresh.cubin").read_bytes()
    assert setup.run(CUBIN, **{variable: value}).returncode == 0
    assert stats(setup.cache)["server_hits"] == 1


def test_a_malformed_compile_step_is_refused(setup: Project) -> None:
    """Plans and stores (:mod:`kernelcache.nvcc.compiling`) that make no sense are answered so."""
    from kernelcache.nvcc.compiling import COMPILE

    setup.warm()
    where = [os.fsencode(setup.project), os.fsencode(setup.cache), b"18", b"6"]
    call = [*where, b"nvcc", *map(os.fsencode, CUBIN)]
    bad_store = [b"not a number", b"0", b"0", b"", b"", b"", b"", b""]
    for items, expected in (
        ([COMPILE, b"unknown", *call], b"fallback malformed"),
        ([COMPILE, b"store", b"1", b"2", b"3", b"/", b"/", b"18"], b"fallback malformed"),
        ([COMPILE, b"store", *bad_store, *call], b"fallback lookup"),
        ([COMPILE, b"plan", *call], b"compile"),  # without the environment: another key
    ):
        reply = _ask_items(setup.cache, items)
        assert reply is not None
        assert b" ".join(reply[: len(expected.split())]) == expected
    assert setup.run().returncode == 0
    assert stats(setup.cache)["server_hits"] == 1


def test_a_client_that_compiles_in_process_gives_its_flight_claim_back(setup: Project) -> None:
    """A client that stops waiting for a planned compile (or cannot start it) runs the
    in-process launcher, which claims the same command: the server must not hold the
    claim for it meanwhile, or the client would wait for its own compile (issue 37's
    single-flight, found in review)."""
    from kernelcache.nvcc.compiling import COMPILE

    setup.warm()
    where = [os.fsencode(setup.project), os.fsencode(setup.cache), b"18", b"6"]
    call = [*where, b"nvcc", *map(os.fsencode, CUBIN)]
    for _ in range(2):  # asked again by the same client: still its compile, no fallback
        reply = _ask_items(setup.cache, [COMPILE, b"plan", *call])
        assert reply is not None
        assert reply[0] == b"compile", reply
    assert _ask_items(setup.cache, [COMPILE, b"abandon", *call]) == [b"ok"]
    claimed = _ask_items(setup.cache, [COMPILE, b"plan", *call])
    assert claimed is not None
    assert claimed[0] == b"compile"
    assert _ask_items(setup.cache, [COMPILE, b"abandon", *call]) == [b"ok"]
