"""Team tier: verified entries in Redis or Redis Cluster, shared by every machine that reaches it.

Key names are in ``layout.py``, the record format in ``format.py``, large
entries in ``chunks.py``. Every call to Redis goes through one
:class:`~kernelcache.stores.redis.guard.Guard`: a circuit breaker, one
deadline for the whole call, and a cap on the bytes a reply may bring.

Concurrency contract: a reader sees no entry or a complete one (chunks are
published by one Lua script; see ``chunks.py``). A value that is not a
whole, valid record is never returned: it is counted, and then deleted when
no writer could have made it, or otherwise remembered for
:data:`~kernelcache.stores.redis.badvalues.BAD_SECONDS` so the next lookup does not pay for it again.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from typing import Any

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import Counters, EntryInfo, FlightLock, Store, bound, validate_key
from kernelcache.stores.redis import chunks, keyless, listing
from kernelcache.stores.redis import client as redis_client
from kernelcache.stores.redis import config as redis_config
from kernelcache.stores.redis import format as fmt
from kernelcache.stores.redis.badvalues import BadValues
from kernelcache.stores.redis.breaker import CircuitBreaker
from kernelcache.stores.redis.guard import Guard, OversizedReply
from kernelcache.stores.redis.layout import Layout
from kernelcache.stores.redis.lease import RedisLease

#: Chunks not yet published expire after this long (a writer that died mid-put).
STAGING_SECONDS = 3600.0
#: Chunks of a replaced or deleted entry stay readable this long for readers in flight.
GRACE_SECONDS = 60.0
#: Replacing a manifest expires at most this many old chunks (a forged one may claim more).
MAX_CHUNKS = 65_536
_READ_ATTEMPTS = 3
_RECORD_REPLY = fmt.MAX_RECORD + chunks.REPLY_FRAMING


class KeptSigned(StoreError):
    """A put refused: a signed entry this client cannot verify is there (see keyless.py)."""


class _Replaced(Exception):
    """The manifest changed while its chunks were being read: read the new one."""


@dataclasses.dataclass(eq=False)
class RedisCounters(Counters):
    """A remote tier's counters: every tier's, plus what only a network tier meets."""

    timeouts: int = 0
    skipped: int = 0  # calls not made while the circuit breaker was open
    breaker_trips: int = 0
    forged: int = 0  # values whose signature was missing or wrong
    oversized: int = 0  # values over the size limits, refused before reading them
    unverifiable: int = 0  # signed values this client has no secret for
    not_replaced: int = 0  # puts refused: a signed entry this client cannot verify is there


class RedisStore(Store):
    """Entries in Redis or Redis Cluster; every Redis failure is a counted StoreError.

    A reader never sees part of an entry. With ``secret`` every value is
    signed (keyed BLAKE3) and unsigned or forged values are rejected and
    counted; without it, signed values are unreadable (counted, never
    deleted). ``ttl`` (seconds) expires entries unused that long; every hit
    refreshes it (sccache #275), except on a ``read_only`` store, which sends
    read commands only (a read-only Redis ACL user). Each call costs at most
    ``timeout`` seconds whatever the server does (plus a transfer allowance
    for chunks); after ``breaker_threshold`` consecutive failures the tier is
    skipped for ``breaker_cooldown`` seconds. Entries over ``max_entry_size``
    bytes are neither stored nor read. URL query parameters (``namespace``,
    ``ttl``, ``timeout``, ``readonly=1``, ``max_entry_size``, ``cluster=1``,
    ``replicas=1``) and the ``redis+cluster://`` scheme fill in what the
    arguments leave unset.
    """

    kind = "redis"
    shared = True
    counters_class = RedisCounters
    counters: RedisCounters

    def __init__(
        self,
        url: str,
        *,
        namespace: str | None = None,
        ttl: float | None = None,
        timeout: float | None = None,
        read_only: bool = False,
        secret: str | bytes | None = None,
        compress_min: int = 4096,
        compress_level: int = 3,
        chunk_size: int = 4 << 20,
        max_entry_size: int | None = None,
        lease: float = 10.0,
        breaker_threshold: int = 3,
        breaker_cooldown: float = 10.0,
        cluster: bool | None = None,
    ) -> None:
        url, options = redis_config.split_url(url)
        super().__init__(read_only=read_only or options.get("readonly", False))
        self.namespace = namespace or options.get("namespace", "default")
        ttl = options.get("ttl") if ttl is None else ttl
        timeout = (
            options.get("timeout", redis_config.DEFAULT_TIMEOUT) if timeout is None else timeout
        )
        if max_entry_size is None:
            max_entry_size = options.get("max_entry_size", redis_config.DEFAULT_MAX_ENTRY_SIZE)
        redis_config.check_options(
            self.namespace, ttl, timeout, chunk_size, compress_min, max_entry_size
        )
        self.cluster = bool(options.get("cluster", False) if cluster is None else cluster)
        self.ttl = ttl
        self.timeout = timeout
        self.secret = redis_config.secret_bytes(secret)
        self._signer = fmt.Signer(self.secret) if self.secret is not None else None
        self.compress_min = compress_min
        self.compress_level = compress_level
        self.chunk_size = chunk_size
        self.max_entry_size = max_entry_size
        self.lease = lease
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown)
        self.bad = BadValues()
        self._shown_url = redis_config.redact(url)
        self._layout = Layout(self.namespace)
        # A read-only store must work for an ACL user allowed only reads: no GETEX.
        self._ttl_ms = int(ttl * 1000) if ttl and not self.read_only else 0
        make = redis_client.factory(
            url, timeout, cluster=self.cluster, replicas=options.get("replicas", False)
        )
        self.guard = Guard(
            make,
            timeout=timeout,
            breaker=self.breaker,
            counters=self.counters,
            label=repr(self),
            replicas=options.get("replicas", False),
            make_breaker=(
                (lambda: CircuitBreaker(breaker_threshold, breaker_cooldown))
                if self.cluster
                else None
            ),
        )

    def __repr__(self) -> str:
        kind = ", cluster" if self.cluster else ""
        return f"RedisStore({self._shown_url!r}, namespace={self.namespace!r}{kind})"

    def _read_args(self, name: str) -> tuple[Any, ...]:
        return ("GETEX", name, "PX", self._ttl_ms) if self._ttl_ms else ("GET", name)

    # Reads ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        validate_key(key)
        name = self._layout.entry(key)
        if self.bad and self.bad.holds(name):
            self.counters.misses += 1
            return None
        for _attempt in range(_READ_ATTEMPTS):
            try:
                raw = self.guard.get(*self._read_args(name), limit=_RECORD_REPLY)
            except OversizedReply as exc:
                self._refuse(key, None, fmt.OversizedEntry(str(exc), deletable=True))
                return None
            if raw is None:
                self.counters.misses += 1
                return None
            try:
                entry, stored = self._decode(key, name, raw)
            except _Replaced:
                continue
            except CorruptEntry as exc:
                self._refuse(key, raw, exc)
                return None
            self.counters.hits += 1
            self.counters.bytes_read += stored
            return entry
        self.counters.misses += 1  # replaced faster than we could read it, three times over
        return None

    def _decode(self, key: str, name: str, raw: bytes | bytearray) -> tuple[Entry, int]:
        record = fmt.open_record(name.encode(), raw, self._signer)
        if not record.flags & fmt.CHUNKED:
            fmt.check_size(record, record.end, self.max_entry_size)
            body = memoryview(raw)[: record.end]
            if record.flags & fmt.ZSTD:
                return Entry.unpack(fmt.decompress(body, record.size), key), len(raw)
            if isinstance(raw, bytes):  # small replies: the artifacts are sliced out of it
                return fmt.unpack_prefix(raw, record.end, key), len(raw)
            return Entry.unpack(body, key), len(raw)  # large ones: copied once out of the buffer
        manifest = fmt.Manifest.decode(bytes(raw[: record.end]))
        manifest.check(self.max_entry_size)
        fmt.check_size(record, manifest.stored, self.max_entry_size)
        payload = self._read_chunks(key, name, raw, manifest)
        if record.flags & fmt.ZSTD:
            payload = fmt.decompress(payload, record.size)
        return Entry.unpack(payload, key), len(raw) + manifest.stored

    def _read_chunks(
        self, key: str, name: str, raw: bytes | bytearray, manifest: fmt.Manifest
    ) -> bytes:
        base = f"{self._layout.chunk_base(key)}{manifest.write_id}:"
        parts = chunks.read(self.guard, base, manifest, self._read_args)
        if parts is None:
            if self.guard.get("GET", name, limit=_RECORD_REPLY) != raw:
                raise _Replaced
            raise CorruptEntry("chunks of the entry are gone (expired or evicted by Redis)")
        payload = b"".join(parts)
        if len(payload) != manifest.stored:
            raise CorruptEntry(
                f"chunks hold {len(payload)} bytes, the manifest says {manifest.stored}"
            )
        if fmt.digest(payload, self._signer is not None) != manifest.digest:
            raise CorruptEntry("chunks fail the manifest's digest")
        return payload

    def _refuse(self, key: str, raw: bytes | bytearray | None, exc: CorruptEntry) -> None:
        """Count a value that is not a hit; delete it or remember it as bad."""
        self.counters.misses += 1
        name = self._layout.entry(key)
        if isinstance(exc, fmt.OtherVersion):
            return  # a clean miss: another version's record, left to its writers
        if isinstance(exc, fmt.ForgedEntry):
            self._count("forged")  # kept: it may be a peer with another secret
        elif isinstance(exc, fmt.UnverifiableEntry):
            self._count("unverifiable")  # kept: a peer with the secret can read it
        elif isinstance(exc, fmt.OversizedEntry):
            self._count("oversized")
        else:
            self._count("corrupt")
        deletable = not isinstance(exc, (fmt.ForgedEntry, fmt.UnverifiableEntry)) and getattr(
            exc, "deletable", True
        )
        if not (deletable and not self.read_only and self._delete_bad(key, name, raw)):
            self.bad.add(name)

    def _delete_bad(self, key: str, name: str, raw: bytes | bytearray | None) -> bool:
        """Whether the bad value is gone; a failure is counted, and the value remembered."""
        try:
            if raw is None:  # never read whole: drop it while it is still too long to be ours
                self.guard.run_script(chunks.DROP_LONGER_LUA, [name], [fmt.MAX_RECORD])
            else:  # unless someone replaced it since we read it
                self._publish(name, key, b"", "", 0, expect=listing.fingerprint(raw))
        except StoreError:
            return False
        return True

    # Writes --------------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        name = self._layout.entry(key)
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        if size > self.max_entry_size:
            self._count("errors")
            raise StoreError(f"{self!r}: entry of {size} bytes is over max_entry_size")
        flags, payload = self._encode(parts, size)
        if len(payload) <= self.chunk_size:
            record = fmt.seal(name.encode(), flags, size, payload, self._signer)
            self._publish_over(name, key, record, "", 0)
            stored = len(record)
        else:
            stored = self._put_chunked(key, name, flags, size, payload)
        self.bad.discard(name)
        self._count("puts")
        self._count("bytes_written", stored)
        return bound(entry, key)

    def _encode(self, parts: list[bytes], size: int) -> tuple[int, bytes]:
        if size >= self.compress_min and fmt.worth_compressing(parts, self.compress_level):
            frame = fmt.compress(parts, size, self.compress_level)
            if frame is not None:
                return fmt.ZSTD, frame
        return 0, b"".join(parts)

    def _put_chunked(self, key: str, name: str, flags: int, size: int, payload: bytes) -> int:
        write_id = secrets.token_hex(16)
        base = f"{self._layout.chunk_base(key)}{write_id}:"
        staging_ms = int(STAGING_SECONDS * 1000)
        count = chunks.write(self.guard, base, payload, self.chunk_size, staging_ms)
        digest = fmt.digest(payload, self._signer is not None)
        manifest = fmt.Manifest(write_id, count, self.chunk_size, len(payload), digest)
        record = fmt.seal(name.encode(), flags | fmt.CHUNKED, size, manifest.encode(), self._signer)
        try:
            published = self._publish_over(name, key, record, write_id, count)
        except KeptSigned:
            chunks.drop(self.guard, base, count)  # else they would wait out their staging expiry
            raise
        if published < 0:
            self._count("errors")
            raise StoreError(f"{self!r}: chunks of {key} expired before they could be published")
        return len(record) + len(payload)

    def _publish_over(self, name: str, key: str, record: bytes, write_id: str, count: int) -> int:
        """Publish a put, never over a signed entry this client cannot verify (issue 20).

        Redis refuses atomically to replace a signed record (``PUBLISH_LUA``'s
        keep-signed check). A client with the secret then reads it: one that
        verifies (the team's) or is damaged is replaced, only if still the same
        value; one signed with another secret stays. A client without the
        secret never replaces a signed record. Refusals are counted
        (``not_replaced``), said once, and raised as :class:`StoreError`.
        """
        result = self._publish(name, key, record, write_id, count, keep_signed=True)
        if result != -2:
            return result
        if self._signer is not None:
            raw = self.guard.get("GET", name, limit=_RECORD_REPLY)
            if raw is None or self._verifies(name, raw):  # gone since, or the team's
                expect = listing.fingerprint(raw) if raw is not None else ""
                result = self._publish(
                    name, key, record, write_id, count, expect=expect, keep_signed=raw is None
                )
                if result != -2:
                    return result
        self._count("not_replaced")
        cause = "has no secret" if self._signer is None else "has a secret that does not verify it"
        keyless.say_once(self, cause)
        raise KeptSigned(f"{self!r}: kept the signed entry {key}: this client {cause}")

    def _verifies(self, name: str, raw: bytes | bytearray) -> bool:
        """Whether this client may replace ``raw``: it verifies, or is damaged (not forged)."""
        try:
            fmt.open_record(name.encode(), raw, self._signer)
        except fmt.ForgedEntry:
            return False  # signed with another secret: not this client's to replace
        except CorruptEntry:
            return True  # damaged: whoever can write may repair it
        return True

    def _publish(
        self,
        name: str,
        key: str,
        record: bytes,
        write_id: str,
        count: int,
        expect: str = "",
        keep_signed: bool = False,
    ) -> int:
        args = [
            record,
            self._ttl_ms,
            self._layout.chunk_base(key),
            write_id,
            count,
            int(GRACE_SECONDS * 1000),
            expect,
            MAX_CHUNKS,
            "1" if keep_signed else "",
        ]
        return int(self.guard.run_script(chunks.PUBLISH_LUA, [name], args, moving=len(record)))

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        name = self._layout.entry(key)
        removed = self._publish(name, key, b"", "", 0) > 0
        self.bad.discard(name)
        if removed:
            self._count("deletes")
        return removed

    def remove_if_unchanged(self, info: EntryInfo) -> bool:
        """Remove the entry ``info`` describes, unless it was published again since.

        A fingerprint of the record is in ``info.extra`` (from :meth:`scan` or
        :meth:`info`); the publish script compares it and deletes in one step.
        """
        expect = info.extra.get("fingerprint")
        if not isinstance(expect, str):
            return self.delete(info.key)
        validate_key(info.key)
        self._check_writable()
        name = self._layout.entry(info.key)
        removed = self._publish(name, info.key, b"", "", 0, expect=expect) > 0
        if removed:
            self._count("deletes")
        return removed

    def flight_lock(self, key: str) -> FlightLock | None:
        """A lease spanning machines; ``None`` on a read-only store (it cannot publish)."""
        validate_key(key)
        if self.read_only:
            return None
        return RedisLease(self.guard, self._layout.lock(key), lease=self.lease)

    # Listing ---------------------------------------------------------------------
    def keys(self) -> Iterator[str]:
        for _node, batch in listing.keys(self.guard, self._layout):
            yield from batch

    def scan(self) -> Iterator[EntryInfo]:
        return listing.infos(self.guard, self._layout)

    def info(self, key: str) -> EntryInfo | None:
        validate_key(key)
        return listing.info(self.guard, self._layout, key)

    def stats(self) -> dict[str, Any]:
        open_nodes = [n for n, b in self.guard.node_breakers.items() if b.state != "closed"]
        return {
            **super().stats(),
            "breaker": self.breaker.state,
            "open_nodes": sorted(open_nodes),
            "url": self._shown_url,
            "namespace": self.namespace,
            "cluster": self.cluster,
        }

    def close(self) -> None:
        self.guard.close()
        super().close()
