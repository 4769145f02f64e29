"""What every object tier (HTTP, S3) does the same way: records, streaming, verification.

An object holds one record in the Redis tier's format
(:mod:`kernelcache.stores.redis.format`): the packed entry (or, for small
entries that shrink, one zstd frame of it), the keyed-BLAKE3 MAC when the team
signs, and the trailer. The MAC covers the key, so an object copied under
another key is forged.

Memory: a put of an entry of N bytes sends the entry's own buffers as they are
(it needs the entry, N, plus the header: nothing is joined); a get of N bytes
reads each artifact straight into the bytes handed out (N plus 64 KiB of
buffers), verifying checksums and the MAC as the bytes arrive. Entries up to
:data:`SMALL` bytes are read whole and may be compressed, which costs up to
twice their size for a moment. Nothing of a record is returned before all of
it verified.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import logging
from typing import Any

from kernelcache import entry_format
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import EntryInfo, FlightLock, Store, bound, validate_key
from kernelcache.stores.http.transport import Call, Transport, check_status, http_time
from kernelcache.stores.redis import format as fmt
from kernelcache.stores.redis.breaker import CircuitBreaker
from kernelcache.stores.redis.config import secret_bytes
from kernelcache.stores.redis.store import KeptSigned, RedisCounters

#: Records up to this size are read whole (and written compressed when that pays).
SMALL = 8 << 20
#: Entries larger than this are neither stored nor read (``max_entry_size=`` in the URL).
DEFAULT_MAX_ENTRY_SIZE = 4 << 30
#: Seconds each call may take (plus the transfer allowance) unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 2.0
_TRAILERS = (fmt.TAIL_SIZE, fmt.TAIL_SIZE + fmt.MAC_SIZE)
_MAX_HEADER = 64 << 20
_log = logging.getLogger("kernelcache")


class UnsignedEntry(fmt.ForgedEntry):
    """An unsigned object where the team signs (a keyless machine's): ignored, and replaced."""


class UncheckedDamage(CorruptEntry):
    """Damage a keyless reader met before it could tell whether the record is signed: kept."""

    deletable = False


class ObjectStore(Store):
    """A team tier of objects under a prefix, one per key; subclasses speak the protocol.

    A subclass sets ``transport`` and implements :meth:`_target` (request path
    and headers of a key's object, signed as the server needs) and
    :meth:`scan`. Concurrency: a server that publishes a PUT whole (S3, nginx's
    WebDAV, bazel-remote) never shows a reader part of an object, and a torn
    or foreign one fails verification anyway. Two machines putting the same
    key at once both succeed; the last one wins, and both wrote the same entry.
    """

    shared = True
    counters_class = RedisCounters
    counters: RedisCounters
    transport: Transport

    def __init__(
        self,
        *,
        read_only: bool,
        secret: str | bytes | None,
        timeout: float,
        max_entry_size: int,
        compress_min: int = 4096,
        compress_level: int = 3,
        breaker_threshold: int = 3,
        breaker_cooldown: float = 10.0,
    ) -> None:
        super().__init__(read_only=read_only)
        self.secret = secret_bytes(secret)
        self._signer = fmt.Signer(self.secret) if self.secret is not None else None
        self.timeout = timeout
        self.max_entry_size = max_entry_size
        self.compress_min = compress_min
        self.compress_level = compress_level
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown)
        #: Keys whose object this client must not replace (signed, and not verifiable here).
        self._kept: set[str] = set()

    # The protocol, for subclasses ----------------------------------------------
    def request_for(
        self, method: str, key: str | None, query: str = ""
    ) -> tuple[str, dict[str, str]]:
        """Request path and headers for ``method`` on ``key``'s object (``None``: the prefix)."""
        raise NotImplementedError

    # Reads -------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        validate_key(key)
        path, headers = self.request_for("GET", key)
        try:
            with self.transport.open("GET", path, headers) as (resp, call):
                if resp.status == 404:
                    resp.read(1 << 16)  # the error page: read, so the connection is kept
                    self.counters.misses += 1
                    return None
                check_status(repr(self), "GET", resp.status, self.counters, (200,))
                entry, stored = self._read(key, resp, call)
        except CorruptEntry as exc:
            self._refuse(key, exc)
            return None
        self.counters.hits += 1
        self.counters.bytes_read += stored
        return entry

    def _read(self, key: str, resp: http.client.HTTPResponse, call: Call) -> tuple[Entry, int]:
        length_text = resp.getheader("Content-Length") or ""
        if not length_text.isdigit():
            raise CorruptEntry("the server gave no Content-Length")
        length = int(length_text)
        if length > self.max_entry_size + fmt.MAC_SIZE + fmt.TAIL_SIZE:
            # Kept: a machine allowed larger entries may have written it.
            raise fmt.OversizedEntry(
                f"object of {length} bytes is over max_entry_size", deletable=False
            )
        if length <= SMALL:
            if length > 1 << 16:  # time to move it (a small one fits the timeout as it is)
                call.fit(length)
            raw = _read_exact(resp, length)
            return self._decode(key, raw), length
        return self._stream(key, resp, call, length), length

    def _decode(self, key: str, raw: bytes) -> Entry:
        if self._signer is not None and len(raw) >= fmt.TAIL_SIZE:
            _size, flags = fmt.read_trailer(raw[-fmt.TAIL_SIZE :])
            if not flags & fmt.SIGNED:
                raise UnsignedEntry("unsigned value where a secret is configured")
        record = fmt.open_record(key.encode(), raw, self._signer)
        if record.flags & fmt.CHUNKED:
            raise CorruptEntry("a chunked record is the Redis tier's, not an object's")
        fmt.check_size(record, record.end, self.max_entry_size)
        if record.flags & fmt.ZSTD:
            body = memoryview(raw)[: record.end]
            return Entry.unpack(fmt.decompress(body, record.size), key)
        return fmt.unpack_prefix(raw, record.end, key)

    def _stream(self, key: str, resp: http.client.HTTPResponse, call: Call, length: int) -> Entry:
        """Read a large record artifact by artifact, each straight into its own bytes."""
        hasher = self._signer.start() if self._signer is not None else None

        def take(n: int) -> bytes:
            call.fit(n)
            data = _read_exact(resp, n)
            if hasher is not None:
                hasher.update(data)
            return data

        try:
            prefix = take(entry_format.PREFIX_SIZE)
            size = entry_format.header_size(prefix)
            if not size <= min(length, _MAX_HEADER):
                raise CorruptEntry(f"entry header of {size} bytes in a {length}-byte object")
            head = prefix + take(size - len(prefix))
            total = entry_format.parse_header(head).total_size
            if length - total not in _TRAILERS:
                raise CorruptEntry(f"object of {length} bytes holds an entry of {total}")
            recorded, meta_raw, artifacts = entry_format.unpack_from(
                head, total, key, lambda n, _offset: take(n)
            )
        except CorruptEntry as exc:
            if self._signer is not None:
                raise
            # Damage found before the trailer says whether the record is signed: a
            # machine without the secret must not delete what may be a team's entry.
            raise UncheckedDamage(str(exc)) from exc
        tail = _read_exact(resp, length - total)
        stored, flags = fmt.read_trailer(tail[-fmt.TAIL_SIZE :])
        if flags & (fmt.ZSTD | fmt.CHUNKED) or stored != total:
            raise CorruptEntry("trailer does not describe the entry before it")
        if bool(flags & fmt.SIGNED) != (len(tail) > fmt.TAIL_SIZE):
            raise CorruptEntry("record truncated inside its signature")
        if self._signer is None:
            if flags & fmt.SIGNED:
                raise fmt.UnverifiableEntry(
                    "signed value, and this client has no secret to check it"
                )
        elif not flags & fmt.SIGNED:
            raise UnsignedEntry("unsigned value where a secret is configured")
        else:
            mac = self._signer.finish(hasher, key.encode(), tail[fmt.MAC_SIZE :])
            if not hmac.compare_digest(mac, tail[: fmt.MAC_SIZE]):
                raise fmt.ForgedEntry("value fails its keyed BLAKE3 signature")
        return Entry.from_verified(artifacts, meta_raw, recorded)

    def _refuse(self, key: str, exc: CorruptEntry) -> None:
        """Count an object that is not a hit; delete it when no peer could want it."""
        self.counters.misses += 1
        if isinstance(exc, fmt.OtherVersion):
            return
        if isinstance(exc, fmt.ForgedEntry):
            self._count("forged")
            if not isinstance(exc, UnsignedEntry):
                self._kept.add(key)  # another secret's, maybe: not ours to replace
        elif isinstance(exc, fmt.UnverifiableEntry):
            self._count("unverifiable")
            self._kept.add(key)
        elif isinstance(exc, fmt.OversizedEntry):
            self._count("oversized")
        else:
            self._count("corrupt")
        deletable = not isinstance(exc, (fmt.ForgedEntry, fmt.UnverifiableEntry)) and getattr(
            exc, "deletable", True
        )
        if deletable and not self.read_only:
            # A failure is counted by the transport; the next reader refuses it again.
            with contextlib.suppress(StoreError):
                self._delete(key)

    # Writes ------------------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        if size > self.max_entry_size:
            self._count("errors")
            raise StoreError(f"{self!r}: entry of {size} bytes is over max_entry_size")
        if key in self._kept:
            self._keep(key)
        body = self._seal(key, parts, size)
        if self._signer is not None:
            self._send_put(key, body)
        elif size <= SMALL and self.conditional():
            # A machine without the secret never replaces a signed entry (keyless.py):
            # where none is, one conditional PUT; only when one is there, a look at it.
            if self._send_put(key, body, if_absent=True) == 412:
                if self._signed_there(key):
                    self._keep(key)
                self._send_put(key, body)
        else:
            if self._signed_there(key):
                self._keep(key)
            self._send_put(key, body)
        self._count("puts")
        self._count("bytes_written", sum(map(len, body)))
        return bound(entry, key)

    def _send_put(self, key: str, body: list[bytes], *, if_absent: bool = False) -> int:
        path, headers = self.request_for("PUT", key)
        if if_absent:
            headers["If-None-Match"] = "*"
        ok = (200, 201, 204, 412) if if_absent else (200, 201, 204)
        with self.transport.open("PUT", path, headers, body) as (resp, _call):
            resp.read(1 << 16)
            check_status(repr(self), "PUT", resp.status, self.counters, ok)
            return resp.status

    #: Whether the server refuses ``If-None-Match: *`` over an existing object
    #: (probed on first use, see lease.py; nginx's WebDAV module overwrites).
    conditional_writes: bool | None = None

    def conditional(self) -> bool:
        """Whether conditional creates work on this server (probed once)."""
        if self.conditional_writes is None:
            from kernelcache.stores.http.lease import honours_if_none_match

            self.conditional_writes = honours_if_none_match(self)
        return self.conditional_writes

    def _seal(self, key: str, parts: list[bytes], size: int) -> list[bytes]:
        """The record's buffers: the entry's own (or one zstd frame), then MAC and trailer."""
        flags = 0
        if self.compress_min <= size <= SMALL and fmt.worth_compressing(parts, self.compress_level):
            frame = fmt.compress(parts, size, self.compress_level)
            if frame is not None:
                flags, parts = fmt.ZSTD, [frame]
        if self._signer is None:
            return [*parts, fmt.trailer(size, flags)]
        tail = fmt.trailer(size, flags | fmt.SIGNED)
        hasher = self._signer.start()
        for part in parts:
            hasher.update(part)
        return [*parts, self._signer.finish(hasher, key.encode(), tail), tail]

    def _signed_there(self, key: str) -> bool:
        """Whether a signed record is stored under ``key`` (its trailer, by a ranged GET)."""
        path, headers = self.request_for("GET", key)
        headers["Range"] = f"bytes=-{fmt.TAIL_SIZE}"
        with self.transport.open("GET", path, headers) as (resp, _call):
            length = resp.getheader("Content-Length") or ""
            if resp.status == 200 and not (length.isdigit() and int(length) <= 1 << 16):
                return True  # Range ignored, too long to read for this: as if signed (kept)
            data = resp.read(1 << 16)
        if resp.status not in (200, 206) or len(data) < fmt.TAIL_SIZE:
            return False
        try:
            _size, flags = fmt.read_trailer(data[-fmt.TAIL_SIZE :])
        except CorruptEntry:
            return False
        return bool(flags & fmt.SIGNED)

    def _keep(self, key: str) -> None:
        from kernelcache.stores.redis import keyless

        self._count("not_replaced")
        cause = "has no secret" if self._signer is None else "has a secret that does not verify it"
        keyless.say_once(self, cause)
        raise KeptSigned(f"{self!r}: kept the signed entry {key}: this client {cause}")

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        self._kept.discard(key)
        removed = self._delete(key)
        if removed:
            self._count("deletes")
        return removed

    #: Whether a DELETE of a missing object answers 404 (S3 answers 204 either way).
    delete_says_missing = True

    def _delete(self, key: str) -> bool:
        if not self.delete_says_missing and self.info(key) is None:
            return False
        path, headers = self.request_for("DELETE", key)
        status, _h, _body = self.transport.request("DELETE", path, headers)
        check_status(repr(self), "DELETE", status, self.counters, (200, 202, 204, 404))
        return status != 404

    def info(self, key: str) -> EntryInfo | None:
        validate_key(key)
        path, headers = self.request_for("HEAD", key)
        status, reply, _body = self.transport.request("HEAD", path, headers)
        if status == 404:
            return None
        check_status(repr(self), "HEAD", status, self.counters, (200,))
        modified = http_time(reply.get("Last-Modified"))
        return EntryInfo(key, int(reply.get("Content-Length") or 0), modified, modified)

    #: Whether this tier offers cross-machine leases: ``None`` probes the server on
    #: first use; ``False`` when another tier of the stack (Redis) holds them.
    leases: bool | None = None
    #: Seconds a lease lasts unless renewed (a holder that died blocks no one longer).
    lease_seconds = 30.0

    def flight_lock(self, key: str) -> FlightLock | None:
        """A lease spanning machines, where the server honours conditional creates (probed)."""
        validate_key(key)
        if self.read_only or self.leases is False:
            return None
        if self.leases is None:
            self.leases = self.conditional()
        if not self.leases:
            return None
        from kernelcache.stores.http.lease import ObjectLease

        return ObjectLease(self, key, lease=self.lease_seconds)

    def ping(self) -> float:
        """Seconds one round trip to the server takes (a HEAD of a key nobody uses)."""
        import time

        start = time.perf_counter()
        self.info("kernelcache-ping")
        return time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "breaker": self.breaker.state}

    def close(self) -> None:
        self.transport.close()
        super().close()


def _read_exact(resp: http.client.HTTPResponse, n: int) -> bytes:
    data = resp.read(n)
    if len(data) != n:
        raise CorruptEntry(f"object ended after {len(data)} of {n} bytes")
    return data


def _iso_time(text: str | None) -> float:
    """Seconds since the epoch of an ISO 8601 time (S3 listings); 0.0 if absent or bad."""
    import datetime

    if not text:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
