"""Team tier: verified entries in Redis, shared by every machine that reaches it.

Keys (``ns`` is the namespace, ``key`` the cache key)::

    kc:<ns>:e:<key>                 the record (stores/redis_format.py): a small entry
                                    inline, or the manifest of a chunked one
    kc:<ns>:c:<key>:<write id>:<i>  chunk i of a large entry, one fresh write id per put
    kc:<ns>:lock:<key>              the single-flight lease (stores/redis_lease.py)

Concurrency contract: a reader sees no entry or a complete one. Chunks are
written under a fresh write id with a staging expiry, then one Lua script
checks they are all there, swaps the manifest in, makes the chunks permanent
(or gives them the TTL) and lets the replaced chunks expire after a grace
period, so a reader still fetching them finishes undisturbed. Writers crashing
before the swap leave chunks that expire by themselves.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import (
    Counters,
    EntryInfo,
    FlightLock,
    Store,
    bound,
    is_valid_key,
    validate_key,
)
from kernelcache.stores.redis import config as redis_config
from kernelcache.stores.redis import format as fmt
from kernelcache.stores.redis.breaker import CircuitBreaker
from kernelcache.stores.redis.lease import RELEASE_LUA, RENEW_LUA, RedisLease

#: Chunks not yet published expire after this long (a writer that died mid-put).
STAGING_SECONDS = 3600.0
#: Chunks of a replaced or deleted entry stay readable this long for readers in flight.
GRACE_SECONDS = 60.0
#: A manifest may not name more chunks than this (it bounds the publish script's loop).
MAX_CHUNKS = 100_000
_SCAN_COUNT = 1000
_PIPELINE_CHUNKS = 16
_READ_ATTEMPTS = 3


class _Replaced(Exception):
    """The manifest changed while its chunks were being read: read the new one."""


class RedisCounters(Counters):
    """A remote tier's counters: every tier's, plus what only a network tier meets."""

    names = (*Counters.names, "timeouts", "skipped", "breaker_trips", "forged")

    timeouts: int
    skipped: int  # calls not made while the circuit breaker was open
    breaker_trips: int
    forged: int  # values whose signature was missing or wrong


class RedisStore(Store):
    """Entries in Redis for a team or cluster; every Redis failure is a counted StoreError.

    A reader never sees part of an entry (see the module docstring). With
    ``secret`` every value is HMAC-SHA256-signed and unsigned or forged values
    are rejected and counted. ``ttl`` (seconds) expires entries unused that
    long; every hit refreshes it (sccache #275: entries in daily use went
    cold), except on a ``read_only`` store, which sends read commands only so
    that it works with a read-only Redis ACL user. After ``breaker_threshold``
    consecutive connection failures or timeouts the tier is skipped for
    ``breaker_cooldown`` seconds, then probed again. Query parameters of the
    URL (``namespace``, ``ttl``, ``timeout``, ``readonly=1``) fill in what the
    arguments leave unset.
    """

    kind = "redis"
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
        max_entry_size: int = 2 << 30,
        lease: float = 10.0,
        breaker_threshold: int = 3,
        breaker_cooldown: float = 10.0,
    ) -> None:
        url, options = redis_config.split_url(url)
        super().__init__(read_only=read_only or options.get("readonly", False))
        self.namespace = namespace or options.get("namespace", "default")
        ttl = options.get("ttl") if ttl is None else ttl
        timeout = options.get("timeout", 0.5) if timeout is None else timeout
        redis_config.check_options(self.namespace, ttl, timeout, chunk_size, compress_min)
        self.ttl = ttl
        self.timeout = timeout
        self.secret = redis_config.secret_bytes(secret)
        self.compress_min = compress_min
        self.compress_level = compress_level
        self.chunk_size = chunk_size
        self.max_entry_size = max_entry_size
        self.lease = lease
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown)
        self._shown_url = redis_config.redact(url)
        self._prefix = f"kc:{self.namespace}:"
        self._entries = f"{self._prefix}e:"
        # A read-only store must work for an ACL user allowed only reads: no GETEX.
        self._ttl_ms = int(ttl * 1000) if ttl and not self.read_only else 0
        self._client, self._errors = redis_config.connect(url, timeout)
        self._scripts = {
            name: self._client.register_script(lua)
            for name, lua in (
                ("publish", fmt.PUBLISH_LUA),
                ("release", RELEASE_LUA),
                ("renew", RENEW_LUA),
            )
        }

    def __repr__(self) -> str:
        return f"RedisStore({self._shown_url!r}, namespace={self.namespace!r})"

    # The guarded call: every Redis error becomes a counted StoreError ----------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.breaker.allow():
            self._count("skipped")
            raise StoreError(f"{self!r}: skipped, circuit open after repeated failures")
        unreachable, timeout, any_error = self._errors
        try:
            result = fn(*args)
        except unreachable as exc:
            self._count("errors")
            if isinstance(exc, timeout):
                self._count("timeouts")
            if self.breaker.record_failure():
                self._count("breaker_trips")
            raise StoreError(f"{self!r}: {type(exc).__name__}: {exc}") from exc
        except any_error as exc:  # the server answered (an error reply): it is not down
            self._count("errors")
            self.breaker.record_success()
            raise StoreError(f"{self!r}: {type(exc).__name__}: {exc}") from exc
        self.breaker.record_success()
        return result

    def _script(self, name: str) -> Callable[..., Any]:
        return self._scripts[name]  # type: ignore[no-any-return]

    def _set_nx(self, name: str, token: str, lease_ms: int) -> bool:
        reply = self._call(self._client.execute_command, "SET", name, token, "NX", "PX", lease_ms)
        return reply is not None

    def _read_command(self, name: str) -> tuple[Any, ...]:
        return ("GETEX", name, "PX", self._ttl_ms) if self._ttl_ms else ("GET", name)

    # Reads ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        validate_key(key)
        name = self._entries + key
        for _attempt in range(_READ_ATTEMPTS):
            raw = self._call(self._client.execute_command, *self._read_command(name))
            if raw is None:
                self.counters.misses += 1
                return None
            try:
                entry, stored = self._decode(key, name, raw)
            except _Replaced:
                continue
            except fmt.ForgedEntry:
                self._count("forged")  # never deleted: it may be a peer with another secret
                self.counters.misses += 1
                return None
            except CorruptEntry:
                self._count("corrupt")
                self.counters.misses += 1
                self._discard(name, raw)
                return None
            self.counters.hits += 1
            self.counters.bytes_read += stored
            return entry
        self.counters.misses += 1  # replaced faster than we could read it, three times over
        return None

    def _decode(self, key: str, name: str, raw: bytes) -> tuple[Entry, int]:
        record = fmt.open_record(name.encode(), raw, self.secret)
        if record.size > self.max_entry_size:
            raise CorruptEntry(f"record claims {record.size} bytes, over max_entry_size")
        payload: bytes | memoryview = record.body
        stored = len(raw)
        if record.flags & fmt.CHUNKED:
            payload = self._read_chunks(key, name, raw, fmt.Manifest.decode(record.body))
            stored += len(payload)
        if record.flags & fmt.ZSTD:
            payload = fmt.decompress(payload, record.size)
        elif len(payload) != record.size:
            raise CorruptEntry(f"payload is {len(payload)} bytes, the record says {record.size}")
        return Entry.unpack(payload, key), stored

    def _read_chunks(self, key: str, name: str, raw: bytes, manifest: fmt.Manifest) -> bytes:
        if manifest.chunks > MAX_CHUNKS or manifest.stored > self.max_entry_size:
            raise CorruptEntry(f"manifest of {manifest.chunks} chunks is out of bounds")
        base = f"{self._prefix}c:{key}:{manifest.write_id}:"
        parts: list[bytes | None] = []
        for start in range(0, manifest.chunks, _PIPELINE_CHUNKS):
            pipe = self._client.pipeline(transaction=False)
            for i in range(start, min(start + _PIPELINE_CHUNKS, manifest.chunks)):
                pipe.execute_command(*self._read_command(f"{base}{i}"))
            parts.extend(self._call(pipe.execute))
        if any(part is None for part in parts):
            if self._call(self._client.get, name) != raw:
                raise _Replaced
            raise CorruptEntry("chunks of the entry are gone (expired or evicted by Redis)")
        payload = b"".join(parts)  # type: ignore[arg-type]
        if len(payload) != manifest.stored:
            raise CorruptEntry(
                f"chunks hold {len(payload)} bytes, the manifest says {manifest.stored}"
            )
        if fmt.digest(payload, self.secret is not None) != manifest.digest:
            raise CorruptEntry("chunks fail the manifest's digest")
        return payload

    def _discard(self, name: str, raw: bytes) -> None:
        """Delete a damaged value, unless someone replaced it since we read it."""
        if self.read_only or (raw[:3] == fmt.MAGIC and raw[3:4] != bytes([fmt.VERSION])):
            return  # a record of another format version belongs to a peer: leave it
        try:
            self._publish(
                name, b"", "", 0, expect=hashlib.sha1(raw, usedforsecurity=False).hexdigest()
            )
        except StoreError:
            return  # counted; the next put overwrites the damaged value anyway

    # Writes --------------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        name = self._entries + key
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        if size > self.max_entry_size:
            self._count("errors")
            raise StoreError(f"{self!r}: entry of {size} bytes is over max_entry_size")
        flags, payload = self._encode(parts, size)
        if len(payload) <= self.chunk_size:
            record = fmt.seal(name.encode(), flags, size, payload, self.secret)
            self._publish(name, record, "", 0)
            stored = len(record)
        else:
            stored = self._put_chunked(key, name, flags, size, payload)
        self._count("puts")
        self._count("bytes_written", stored)
        return bound(entry, key)

    def _encode(self, parts: list[bytes], size: int) -> tuple[int, bytes]:
        if size >= self.compress_min and fmt.worth_compressing(parts, self.compress_level):
            packed = fmt.compress(parts, size, self.compress_level)
            if len(packed) < size * 0.9:  # incompressible payloads are stored as they are
                return fmt.ZSTD, packed
        return 0, b"".join(parts)

    def _put_chunked(self, key: str, name: str, flags: int, size: int, payload: bytes) -> int:
        import secrets

        write_id = secrets.token_hex(16)
        base = f"{self._prefix}c:{key}:{write_id}:"
        view = memoryview(payload)
        starts = range(0, len(payload), self.chunk_size)
        for first in range(0, len(starts), _PIPELINE_CHUNKS):
            pipe = self._client.pipeline(transaction=False)
            for i in range(first, min(first + _PIPELINE_CHUNKS, len(starts))):
                chunk = view[starts[i] : starts[i] + self.chunk_size]
                pipe.set(f"{base}{i}", chunk, px=int(STAGING_SECONDS * 1000))
            self._call(pipe.execute)
        manifest = fmt.Manifest(
            write_id, len(starts), len(payload), fmt.digest(payload, self.secret is not None)
        )
        record = fmt.seal(name.encode(), flags | fmt.CHUNKED, size, manifest.encode(), self.secret)
        if self._publish(name, record, write_id, len(starts)) < 0:
            self._count("errors")
            raise StoreError(f"{self!r}: chunks of {key} expired before they could be published")
        return len(record) + len(payload)

    def _publish(
        self, name: str, record: bytes, write_id: str, chunks: int, expect: str = ""
    ) -> int:
        base = f"{self._prefix}c:{name[len(self._entries) :]}:"
        args = [
            record,
            self._ttl_ms,
            base,
            write_id,
            chunks,
            int(GRACE_SECONDS * 1000),
            expect,
            MAX_CHUNKS,
        ]
        return int(self._call(self._scripts["publish"], [name], args))

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        removed = self._publish(self._entries + key, b"", "", 0) > 0
        if removed:
            self._count("deletes")
        return removed

    def flight_lock(self, key: str) -> FlightLock | None:
        """A lease spanning machines; ``None`` on a read-only store (it cannot publish)."""
        validate_key(key)
        if self.read_only:
            return None
        return RedisLease(self, f"{self._prefix}lock:{key}", lease=self.lease)

    # Listing (SCAN, never KEYS: KEYS blocks the server for the whole keyspace) -----
    def _scan_names(self) -> Iterator[list[str]]:
        cursor = 0
        pattern = self._entries + "*"
        while True:
            cursor, names = self._call(self._client.scan, cursor, pattern, _SCAN_COUNT)
            keys = [n.decode(errors="replace")[len(self._entries) :] for n in names]
            yield [k for k in keys if is_valid_key(k)]
            if cursor == 0:
                return

    def keys(self) -> Iterator[str]:
        for batch in self._scan_names():
            yield from batch

    def scan(self) -> Iterator[EntryInfo]:
        for batch in self._scan_names():
            pipe = self._client.pipeline(transaction=False)
            for key in batch:  # OBJECT IDLETIME first: the reads after it reset the idle clock
                pipe.object("idletime", self._entries + key)
                pipe.getrange(self._entries + key, 0, fmt.PREFIX_BYTES - 1)
                pipe.strlen(self._entries + key)
            replies = self._call(pipe.execute, False)
            now = time.time()
            for i, key in enumerate(batch):
                info = _entry_info(key, now, *replies[3 * i : 3 * i + 3])
                if info is not None:
                    yield info

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "breaker": self.breaker.state,
            "url": self._shown_url,
            "namespace": self.namespace,
        }

    def close(self) -> None:
        self._client.close()
        super().close()


def _entry_info(key: str, now: float, idle: Any, prefix: Any, strlen: Any) -> EntryInfo | None:
    if not isinstance(prefix, bytes) or not prefix:
        return None  # gone since the SCAN, or not a string
    try:
        flags, size, manifest = fmt.peek(prefix)
    except CorruptEntry:
        return None  # not one of ours: neither listed nor touched
    stored = int(strlen) + (manifest.stored if manifest else 0)
    last_access = now - idle if isinstance(idle, int) else 0.0  # no IDLETIME under LFU policies
    extra = {
        "packed_size": size,
        "compressed": bool(flags & fmt.ZSTD),
        "signed": bool(flags & fmt.SIGNED),
    }
    if manifest:
        extra["chunks"] = manifest.chunks
    return EntryInfo(key, stored, last_access, extra=extra)
