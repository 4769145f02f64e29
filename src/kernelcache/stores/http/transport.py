"""Guarded HTTP calls for the object tiers (HTTP and S3): one deadline, a breaker, counted errors.

Plain :mod:`http.client` on a keep-alive connection per thread: it costs
nothing to import (boto3 costs ~0.3 s, see docs/object-storage.md) and a GET
is one request on an open socket. Every call goes through the tier's circuit
breaker and ends by one deadline (``timeout`` plus ``moving`` bytes at
:data:`TRANSFER_FLOOR` bytes per second): the socket's timeout is set to what
is left of it before the request, before the reply and before each large
read. An outage, a timeout or a 5xx is a counted :class:`StoreError`; after
``breaker_threshold`` such failures in a row the tier is skipped for a while.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from kernelcache.errors import StoreError
from kernelcache.stores.base import Counters
from kernelcache.stores.redis.breaker import CircuitBreaker

#: A call moving N bytes may take N / TRANSFER_FLOOR seconds more than its timeout.
TRANSFER_FLOOR = 16 << 20
#: Methods that may be sent again on a fresh connection when a kept-alive one was closed.
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})


class ServerFailed(StoreError):
    """The server answered 5xx: as good as down for this call."""


class _Held:
    """A thread's connection, closed the moment its thread (or its transport) lets go of it:
    left to the garbage collector, a socket closes late, with a ResourceWarning."""

    __slots__ = ("__weakref__", "conn", "pid")

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.pid = os.getpid()

    def __del__(self) -> None:
        self.conn.close()


class Call:
    """One call's deadline, for the reads its caller makes from the reply."""

    __slots__ = ("conn", "deadline")

    def __init__(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline

    def fit(self, more: int = 0) -> None:
        """Give the socket what is left of the deadline (plus ``more`` bytes' allowance)."""
        self.deadline += more / TRANSFER_FLOOR
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the call's deadline passed")
        if self.conn.sock is not None:
            self.conn.sock.settimeout(remaining)


class Transport:
    """Calls to one origin (``scheme://host:port``), thread-safe; counts into ``counters``."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int | None,
        *,
        timeout: float,
        breaker: CircuitBreaker,
        counters: Counters,
        label: str,
    ) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.timeout = timeout
        self.breaker = breaker
        self.counters = counters
        self.label = label
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: weakref.WeakSet[_Held] = weakref.WeakSet()  # for close()

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port in (None, default) else f"{self.host}:{self.port}"

    def _connection(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection and whether it was used before (it may be stale)."""
        held: _Held | None = getattr(self._local, "held", None)
        if held is not None and (fresh or held.pid != os.getpid()):
            held.conn.close()
            held = None
        if held is not None:
            return held.conn, True
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=self.timeout)
        held = self._local.held = _Held(conn)
        with self._lock:
            self._all.add(held)
        return conn, False

    @contextlib.contextmanager
    def open(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Sequence[bytes] | None = None,
        *,
        moving: int = 0,
    ) -> Iterator[tuple[http.client.HTTPResponse, Call]]:
        """Send a request; yield the reply (status < 500) and its :class:`Call`.

        Whatever the caller leaves unread of the reply is dropped with the
        connection. An error raised by the caller passes through untouched.
        """
        if not self.breaker.allow():
            self.counters.add("skipped")
            raise StoreError(f"{self.label}: skipped, circuit open after repeated failures")
        size = sum(map(len, body)) if body is not None else 0
        deadline = time.monotonic() + self.timeout + (moving + size) / TRANSFER_FLOOR
        try:
            resp, call = self._send(method, path, headers, body, size, deadline)
            if resp.status >= 500 and method in ("GET", "HEAD"):
                # radosgw answers 500 to a GET racing a PUT or DELETE of the same
                # object; the next GET sees one or the other. Once, within the deadline.
                call.conn.close()
                resp, call = self._send(method, path, headers, body, size, deadline)
        except (OSError, http.client.HTTPException) as exc:
            self._failed(exc, timed_out=time.monotonic() >= deadline)
            raise StoreError(f"{self.label}: {method} failed: {type(exc).__name__}: {exc}") from exc
        if resp.status >= 500:
            call.conn.close()
            failed = ServerFailed(f"{self.label}: {method} answered {resp.status} {resp.reason}")
            self._failed(failed, timed_out=False)
            raise failed
        self.breaker.record_success()
        try:
            yield resp, call
        except (OSError, http.client.HTTPException) as exc:
            call.conn.close()
            self._failed(exc, timed_out=time.monotonic() >= call.deadline)
            raise StoreError(f"{self.label}: {method} failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            call.conn.close()  # the rest of the reply must not be read as the next one's
            raise
        if not resp.isclosed():
            call.conn.close()

    def _send(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Sequence[bytes] | None,
        size: int,
        deadline: float,
    ) -> tuple[http.client.HTTPResponse, Call]:
        fresh = False
        while True:
            conn, reused = self._connection(fresh)
            call = Call(conn, deadline)
            try:
                if conn.sock is None:
                    conn.timeout = max(deadline - time.monotonic(), 0.001)
                    conn.connect()
                call.fit()
                sent = dict(headers)
                if body is not None or method == "PUT":
                    sent["Content-Length"] = str(size)
                conn.request(method, path, body=body, headers=sent)
                if size > TRANSFER_FLOOR // 100:  # the send took a while: give the rest
                    call.fit()
                return conn.getresponse(), call
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                conn.close()
                # A kept-alive connection the server closed meanwhile: once more, afresh.
                if not reused or method not in _IDEMPOTENT:
                    raise
                fresh = True
            except BaseException:
                conn.close()
                raise

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Sequence[bytes] | None = None,
        *,
        limit: int = 1 << 20,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """``(status, headers, body)`` of a call whose reply is small (at most ``limit`` bytes)."""
        with self.open(method, path, headers, body) as (resp, call):
            # A HEAD's Content-Length is the object's, and no body follows.
            length = resp.getheader("Content-Length") if method != "HEAD" else None
            if length is not None and length.isdigit() and int(length) > limit:
                raise StoreError(f"{self.label}: a {length}-byte reply, over the {limit} allowed")
            if length is not None and length.isdigit() and int(length) > 1 << 16:
                call.fit(int(length))  # a long listing: the time to move it
            data = resp.read(limit + 1)  # a HEAD's is empty; reading it frees the connection
            if len(data) > limit:
                raise StoreError(f"{self.label}: a reply over the {limit} bytes allowed")
            return resp.status, resp.headers, data

    def _failed(self, exc: BaseException, *, timed_out: bool) -> None:
        self.counters.add("errors")
        if timed_out or isinstance(exc, TimeoutError):
            self.counters.add("timeouts")
        if self.breaker.record_failure():
            self.counters.add("breaker_trips")

    def close(self) -> None:
        with self._lock:
            held = list(self._all)
        for one in held:
            one.conn.close()


def check_status(label: str, method: str, status: int, counters: Any, ok: Sequence[int]) -> None:
    """Raise a counted :class:`StoreError` unless ``status`` is one of ``ok`` (4xx: refused)."""
    if status not in ok:
        counters.add("errors")
        hints = {
            301: " (an S3 bucket in another region: set ?region= or AWS_REGION)",
            401: " (check the credentials)",
            403: " (check the credentials and the bucket's policy)",
        }
        hint = hints.get(status, "")
        raise StoreError(f"{label}: {method} answered {status}{hint}")


def http_time(text: str | None) -> float:
    """Seconds since the epoch of an HTTP date (``Last-Modified``); 0.0 if absent or bad."""
    import email.utils

    if not text:
        return 0.0
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return 0.0
