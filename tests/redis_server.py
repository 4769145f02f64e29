"""A real ``redis-server`` on a free loopback port, for the tests: start, kill, pause, restart.

Never port 6379 (a developer's own Redis may live there) and never a non-loopback
address. Nothing is persisted (``--save '' --appendonly no``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from object_servers import free_port

BINARY = shutil.which("redis-server")
SKIP_REASON = (
    "redis-server binary not found: install it (apt-get install redis-server); "
    "scripts/test.sh installs it when missing"
)


#: The timeout of a test's store where the test is not about timeouts: generous, so that
#: a loaded 2-core CI (load 4) never turns a slow reply into a counted error; such tests
#: assert counters and what Redis holds, never how long a call took (issue 20, item 10).
LOADED = 30.0


class RedisServer:
    """One redis-server process; ``restart`` brings it back on the same port, empty.

    ``extra`` are more command-line options (a cluster node's); ``port`` a
    port to use instead of a free one picked here.
    """

    def __init__(self, directory: Path, extra: tuple[str, ...] = (), port: int = 0) -> None:
        if BINARY is None:
            raise RuntimeError(SKIP_REASON)
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.extra = extra
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def team_url(self, namespace: str) -> str:
        """A ``KERNELCACHE_REMOTE`` for a namespace here, with the generous timeout of a
        test not about timeouts (:data:`LOADED`): processes compiling side by side on a
        loaded 2-core machine lose a put, or miss, when a call outlasts the default 0.5 s."""
        return f"{self.url}?namespace={namespace}&timeout={LOADED:g}"

    def start(self, attempts: int = 5) -> None:
        for _ in range(attempts):
            if self._launch():
                return
            self.port = free_port()  # lost a race for the port with another process
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def restart(self) -> None:
        """Start again on the same port (clients keep their URL)."""
        if not self._launch(wait=10.0):
            raise RuntimeError(f"redis-server did not restart on port {self.port}")

    def _launch(self, wait: float = 5.0) -> bool:
        assert self.process is None or self.process.poll() is not None
        args = [str(BINARY), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        args += ["--logfile", str(self.directory / "redis.log"), *self.extra]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if self.ping():
                if self._answering_pid() == self.process.pid:
                    return True
                # Another process's server took the port first (a free port is picked,
                # then bound later): ours cannot bind; try another port.
                break
            time.sleep(0.02)
        self.kill()
        return False

    def _answering_pid(self) -> int | None:
        """The pid of the redis-server answering on this port (``INFO server``)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5.0) as s:
                s.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
        except OSError:
            return None
        for line in reply.decode(errors="replace").splitlines():
            if line.startswith("process_id:"):
                return int(line.split(":", 1)[1])
        return None

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: connections drop, the data is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (what a timeout looks like)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def _serve(directory: Path) -> Iterator[RedisServer]:
    if BINARY is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the session; tests isolate themselves by namespace, never kill it."""
    yield from _serve(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, which it may kill, pause and restart."""
    yield from _serve(tmp_path / "redis")


def unique_namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def ns() -> str:
    """A namespace of its own for each test: tests sharing one server never see each other."""
    return unique_namespace()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain redis-py client of the suite's server, to look at or damage what a test stored."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()
