"""A misbehaving TCP proxy in front of a real redis-server, for the tests.

Requests pass through untouched; replies pass (``"pass"``), trickle a few
bytes at a time (``"trickle"``: ``step`` bytes every ``interval`` seconds), or
turn into garbage (``"garbage"``). The mode can change while connections are
open. Listens on 127.0.0.1 only; bounded in connections, and every thread ends
within a second of :meth:`close`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from redis_server import RedisServer

MAX_CONNECTIONS = 32
GARBAGE = b"HTTP/1.1 400 Bad Request\r\n\r\n\x00\xff not redis"


class MisbehavingProxy:
    def __init__(
        self, upstream_port: int, mode: str = "pass", step: int = 4, interval: float = 0.1
    ) -> None:
        self.upstream_port = upstream_port
        self.mode = mode
        self.step = step
        self.interval = interval
        self.connections = 0
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
        return sock

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self.connections >= MAX_CONNECTIONS:
                conn.close()
                continue
            self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:
                conn.close()
                continue
            for sock in (conn, upstream):
                sock.settimeout(0.2)
                self._track(sock)
            self._spawn(self._requests, conn, upstream)
            self._spawn(self._replies, upstream, conn)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        for data in self._chunks(client):
            if not self._send(upstream, data):
                break
        self._close_pair(client, upstream)

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        for data in self._chunks(upstream):
            if self.mode == "garbage":
                data = GARBAGE
            if self.mode == "trickle":
                for start in range(0, len(data), self.step):
                    if self._stop.wait(self.interval):
                        return
                    if not self._send(client, data[start : start + self.step]):
                        return
            elif not self._send(client, data):
                break
        self._close_pair(client, upstream)

    def _chunks(self, sock: socket.socket) -> Iterator[bytes]:
        while not self._stop.is_set():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            yield data

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
        except OSError:
            return False
        return True

    @staticmethod
    def _close_pair(*socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        self._close_pair(*sockets)
        for thread in threads:
            thread.join(timeout=2)


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[MisbehavingProxy]:
    """A proxy to the session's redis-server, passing replies until told otherwise."""
    proxy = MisbehavingProxy(redis_server.port)
    try:
        yield proxy
    finally:
        proxy.close()
