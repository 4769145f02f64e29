"""The socket level of the Redis tier: one deadline per call, capped replies, fast GETs.

redis-py's ``socket_timeout`` bounds each socket read on its own: a server that
trickles its reply (a few bytes every 100 ms) never trips it, and one get cost
7.3 s while the circuit breaker never opened. Here every connection wraps its
socket in a :class:`DeadlineSocket`, so every connect, send and read of a *call*
fits in what is left of that call's deadline, and a reply longer than the call
allows is cut off. :func:`begin` starts a call on this thread (``deadline`` from
``time.monotonic()``, ``limit`` bytes or ``None``), :func:`end` finishes it;
outside a call the sockets behave exactly like redis-py's own.

:class:`ThreadConnections` runs the hit path's GETs on a connection each thread
keeps and reads the bulk reply itself (see its docstring for why).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from typing import Any

#: A socket timeout may overshoot the deadline by this much before it is lowered
#: (each change is a system call; a healthy call needs none).
SLACK = 0.01
#: A call moving N bytes may take N / TRANSFER_FLOOR seconds more than the timeout:
#: the timeout bounds a round trip, not the transfer of a large entry.
TRANSFER_FLOOR = 16 << 20
_READ = 65536


class ReplyTooLarge(Exception):
    """The server sent, or announced, more bytes than the call allows.

    Not an ``OSError``, so redis-py neither retries it nor calls the server
    unreachable: it closes the connection and lets it through.
    """


class _Call(threading.local):
    deadline: float | None = None
    limit: int | None = None
    received = 0


_call = _Call()


def begin(deadline: float, limit: int | None) -> None:
    _call.deadline = deadline
    _call.limit = limit
    _call.received = 0


def end() -> None:
    _call.deadline = None
    _call.limit = None


def _remaining() -> float | None:
    deadline = _call.deadline
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the call's deadline passed")  # socket.timeout: redis-py's timeout
    return remaining


class DeadlineSocket:
    """A connected socket whose reads and writes respect the current call's deadline.

    Timeouts set by redis-py itself (``settimeout(0)`` to poll) are kept; the
    socket's timeout is only lowered when the call has less time left than it.
    """

    __slots__ = ("_lowered", "_sock", "_timeout")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self._lowered = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)
        self._timeout = value
        self._lowered = False

    def gettimeout(self) -> float | None:
        return self._timeout

    def _fit(self) -> None:
        remaining = _remaining()
        if remaining is None:
            return
        current = self._timeout
        if current is None or current > remaining + SLACK:
            self._sock.settimeout(remaining)
            self._timeout = remaining
            self._lowered = True
        elif self._lowered and current < remaining - SLACK:
            # Lowered for an earlier call that ended in time: give this one its own.
            self._sock.settimeout(remaining)
            self._timeout = remaining

    def _count(self, n: int) -> None:
        limit = _call.limit
        if limit is not None:
            _call.received += n
            if _call.received > limit:
                raise ReplyTooLarge(f"reply exceeds the {limit} bytes this call allows")

    def recv(self, size: int, flags: int = 0) -> bytes:
        self._fit()
        data = self._sock.recv(size, flags)
        self._count(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._fit()
        n = self._sock.recv_into(buffer, nbytes, flags)
        self._count(n)
        return n

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._fit()
        self._sock.sendall(data, flags)


class _DeadlineConnect:
    """Mixed into a redis-py connection class: connect within the call's deadline.

    ``deadline_socket`` is the socket of the current connection, for readers
    of their own (:class:`ThreadConnections`).
    """

    socket_timeout: float | None
    socket_connect_timeout: float | None
    deadline_socket: DeadlineSocket | None = None

    def _connect(self) -> Any:
        remaining = _remaining()
        if remaining is not None:
            self.socket_connect_timeout = min(self.socket_timeout or remaining, remaining)
        sock = self.deadline_socket = DeadlineSocket(super()._connect())  # type: ignore[misc]
        return sock


_BOUNDED: dict[type, type] = {}


def bounded(base: type) -> type:
    """``base``, a redis-py connection class, with :class:`DeadlineSocket` sockets."""
    cls = _BOUNDED.get(base)
    if cls is None:
        cls = _BOUNDED[base] = type(f"Bounded{base.__name__}", (_DeadlineConnect, base), {})
    return cls


class _Held:
    """A thread's connection; closed as soon as the thread or the store lets go of it.

    redis-py's connections sit in reference cycles, so left to the garbage
    collector they close late and in any order (a ResourceWarning when the
    socket goes first). This holder is in no cycle: it is freed, and closes
    its connection, the moment its thread ends or its store is dropped.
    """

    __slots__ = ("__weakref__", "conn", "ok", "pool")

    def __init__(self, conn: Any, pool: Any) -> None:
        self.conn = conn
        self.pool = pool
        self.ok = False  # the last call on it succeeded: it was open then

    def __del__(self) -> None:
        self.conn.disconnect()


class ThreadConnections:
    """GETs on a connection of each thread's own, whose bulk reply is read here (the hit path).

    Taking a connection from redis-py's pool polls it first (two ``settimeout``
    calls and a failing ``recv``) and records metrics: about 10 us of a 37 us
    GET of 4 KiB here. redis-py's pure-Python parser then copies a large reply
    four or five times (~1.3 ms of a 2.5 ms GET of 1 MiB). Here the reply's
    declared length is checked against the call's limit before a byte of it is
    read, and the bytes land in one buffer. redis-py still connects,
    authenticates and sends. A reused connection that turns out closed (the
    server restarted, an idle timeout) is reconnected once, within the same
    deadline; a forked child makes its own.
    """

    def __init__(self) -> None:
        import redis.exceptions as rx

        self._errors = rx
        self._local = threading.local()
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()  # for close()
        self._lock = threading.Lock()

    def get(self, pool: Any, args: tuple[Any, ...]) -> bytes | bytearray | None:
        """Run ``args`` (a GET or GETEX) on this thread's connection from ``pool``."""
        held_by_pool: dict[int, _Held] | None = getattr(self._local, "held", None)
        if held_by_pool is None or self._local.pid != os.getpid():
            held_by_pool = self._local.held = {}
            self._local.pid = os.getpid()
        held = held_by_pool.get(id(pool))
        if held is None or held.pool is not pool:  # the id of a pool since collected
            held = held_by_pool[id(pool)] = _Held(
                pool.connection_class(**pool.connection_kwargs), pool
            )
            with self._lock:
                self._held.add(held)
        conn, reused = held.conn, held.ok
        held.ok = False
        try:
            reply = self._run(conn, args)
        except self._errors.ConnectionError:  # not a timeout: redis-py keeps those apart
            conn.disconnect()
            if not reused:
                raise
            reply = self._run(conn, args)  # the reconnect, once (GET and GETEX are idempotent)
        except self._errors.ResponseError:
            held.ok = True  # an error reply, read whole: the connection is fine
            raise
        except BaseException:
            conn.disconnect()  # whatever is left of the reply must not be read as the next
            raise
        held.ok = True
        return reply

    def _run(self, conn: Any, args: tuple[Any, ...]) -> bytes | bytearray | None:
        conn.send_command(*args)  # redis-py connects and sends, translating its errors
        sock = conn.deadline_socket
        if sock is None:
            raise self._errors.ConnectionError("the connection has no socket")
        try:
            return self._read_bulk(sock)
        except TimeoutError as exc:  # socket.timeout, as redis-py's parser would say it
            raise self._errors.TimeoutError(f"Timeout reading from socket: {exc}") from exc
        except OSError as exc:
            raise self._errors.ConnectionError(f"Error while reading from socket: {exc}") from exc

    def _read_bulk(self, sock: DeadlineSocket) -> bytes | bytearray | None:
        """One RESP2/RESP3 reply that must be a bulk string, a null or an error."""
        head = self._recv(sock)
        while b"\r\n" not in head[:64]:  # a header split over reads (a trickling server)
            if len(head) > 64:
                raise self._errors.InvalidResponse(f"not a Redis reply: {head[:32]!r}")
            head += self._recv(sock)
        end = head.index(b"\r\n")
        kind, text = head[:1], head[1:end]
        if (kind == b"$" and text == b"-1") or (kind == b"_" and not text):
            return None
        if kind == b"-":
            raise self._errors.ResponseError(text.decode(errors="replace"))
        if kind != b"$" or not text.isdigit():
            raise self._errors.InvalidResponse(f"not a bulk string reply: {head[:32]!r}")
        size, start = int(text), end + 2
        limit = _call.limit
        if limit is not None and size > limit:
            raise ReplyTooLarge(f"a reply of {size} bytes, over the {limit} this call allows")
        if _call.deadline is not None:  # the time to move what the header announced
            _call.deadline += size / TRANSFER_FLOOR
        have = len(head) - start
        if have >= size + 2:
            if have > size + 2 or head[start + size :] != b"\r\n":
                raise self._errors.InvalidResponse("bulk string reply of the wrong length")
            return head[start : start + size]
        buf = bytearray(size + 2)
        buf[:have] = memoryview(head)[start:]
        with memoryview(buf) as view:
            while have < size + 2:
                got = sock.recv_into(view[have:])
                if not got:
                    raise self._errors.ConnectionError("connection closed by the server")
                have += got
        if buf[size:] != b"\r\n":
            raise self._errors.InvalidResponse("bulk string reply of the wrong length")
        del buf[size:]
        return buf

    def _recv(self, sock: DeadlineSocket) -> bytes:
        data = sock.recv(_READ)
        if not data:
            raise self._errors.ConnectionError("connection closed by the server")
        return data

    def close(self) -> None:
        with self._lock:
            held = list(self._held)
        for one in held:
            one.conn.disconnect()
