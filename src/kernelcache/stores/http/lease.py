"""Cross-machine single-flight on an object store alone: a lock object created only if absent.

``PUT <prefix>/.lock/<key>`` with ``If-None-Match: *`` takes the lease (S3,
radosgw and MinIO answer 412 when the object exists); a daemon thread
rewrites it every third of its length while the compile runs; its age is
judged by the server's own clock (``Date`` less ``Last-Modified``), so a
holder that died is taken over a lease later. Release deletes it when it
still holds this holder's token. Whether a server honours the condition is
probed once per store (:func:`honours_if_none_match`), never assumed: nginx's
WebDAV module overwrites instead, and such a tier offers no lease (machines
may then compile the same entry at once; the last put wins, nothing is lost).
With Redis in the stack the lease is Redis's (``remotes.share_leases``).
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from typing import Protocol

from kernelcache.errors import StoreError
from kernelcache.stores.http.transport import Transport, http_time


class ObjectStore(Protocol):
    """What a lease needs of its store (an object tier): requests on one object."""

    transport: Transport

    def request_for(
        self, method: str, key: str | None, query: str = ""
    ) -> tuple[str, dict[str, str]]: ...


LOCKS = ".lock"


def _put_if_absent(store: ObjectStore, name: str, body: bytes) -> int:
    path, headers = store.request_for("PUT", name)
    headers["If-None-Match"] = "*"
    status, _h, _b = store.transport.request("PUT", path, headers, [body])
    return status


def honours_if_none_match(store: ObjectStore) -> bool:
    """Whether the server refuses a conditional create over an existing object (probed)."""
    name = f"{LOCKS}/probe-{secrets.token_hex(8)}"
    first = _put_if_absent(store, name, b"probe")  # a failure here leaves nothing behind
    try:
        second = _put_if_absent(store, name, b"probe")
    finally:
        path, headers = store.request_for("DELETE", name)
        store.transport.request("DELETE", path, headers)
    return first in (200, 201, 204) and second == 412


class ObjectLease:
    """A :class:`~kernelcache.stores.base.FlightLock` held as a lock object, renewed while held."""

    def __init__(self, store: ObjectStore, key: str, *, lease: float, poll: float = 0.1) -> None:
        self.store = store
        self.name = f"{LOCKS}/{key}"
        self.lease = lease
        self.poll = poll
        self.token: bytes | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"ObjectLease({self.name!r}, held={self.token is not None})"

    def acquire(self, timeout: float) -> bool:
        token = secrets.token_hex(16).encode()
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = _put_if_absent(self.store, self.name, token)
                if status in (200, 201, 204):
                    self._hold(token)
                    return True
                if status == 412 and self._stale():
                    self._remove()  # its holder died a lease ago: take over
                    continue
            except StoreError:
                return False  # counted by the store; nobody can coordinate through it now
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, self.poll * random.uniform(0.5, 1.5)))

    def _hold(self, token: bytes) -> None:
        self.token = token
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True)
        self._renewer.start()

    def _stale(self) -> bool:
        path, headers = self.store.request_for("HEAD", self.name)
        status, reply, _b = self.store.transport.request("HEAD", path, headers)
        if status != 200:
            return status == 404  # gone meanwhile: try again at once
        now, written = http_time(reply.get("Date")), http_time(reply.get("Last-Modified"))
        return bool(now and written and now - written > self.lease)

    def _mine(self) -> bool:
        path, headers = self.store.request_for("GET", self.name)
        status, _h, body = self.store.transport.request("GET", path, headers, limit=256)
        return status == 200 and body == self.token

    def _remove(self) -> None:
        path, headers = self.store.request_for("DELETE", self.name)
        self.store.transport.request("DELETE", path, headers)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                if not self._mine():
                    return  # taken over (this process stalled past its lease)
                path, headers = self.store.request_for("PUT", self.name)
                self.store.transport.request("PUT", path, headers, [self.token or b""])
            except StoreError:
                continue  # counted; the next round tries again

    def release(self) -> None:
        token = self.token
        if token is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        self.token = None
        if self._mine_token(token):
            self._remove()

    def _mine_token(self, token: bytes) -> bool:
        self.token = token
        try:
            return self._mine()
        finally:
            self.token = None
