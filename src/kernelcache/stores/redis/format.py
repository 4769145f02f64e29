"""The bytes :class:`~kernelcache.stores.redis.RedisStore` keeps under an entry's key.

Layout of a record (integers little-endian)::

    magic    3  b"KCR"
    version  1
    flags    1  ZSTD=1 (the payload is one zstd frame), CHUNKED=2 (the body is a
                manifest), SIGNED=4 (a MAC follows)
    size     8  length of the packed entry (kernelcache.entry format) after decompression
    mac     32  HMAC-SHA256, only when SIGNED
    body        the payload itself, or for CHUNKED the ASCII manifest
                b"<write id>:<chunk count>:<payload bytes>:<payload digest>"

The MAC covers a domain tag, the Redis key name, the header and the body, so a
signed value cannot be replayed under another key. A manifest's digest covers
the chunks joined: SHA-256 when signed (the MAC then vouches for every chunk),
xxHash3-128 otherwise (integrity only, like the entry's own checksums).

Pure functions; nothing here talks to Redis or can execute code (no pickle).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from kernelcache.errors import CorruptEntry

MAGIC = b"KCR"
VERSION = 1
ZSTD, CHUNKED, SIGNED = 1, 2, 4
_HEAD = struct.Struct("<3sBBQ")
HEAD_SIZE = _HEAD.size
MAC_SIZE = 32
#: A manifest fits in this many bytes: listings read only this prefix of a value.
PREFIX_BYTES = 256
_DOMAIN = b"kernelcache-redis-record-v1\0"
_MANIFEST_RE = re.compile(rb"([0-9a-f]{32}):([0-9]{1,9}):([0-9]{1,15}):([0-9a-f]{32,64})")


# The one writer of records, run atomically by Redis; it parses the header above
# (byte 5: flags; body after 13 or 13 + 32 bytes) to expire the chunks a record
# replaces. KEYS[1] record key. ARGV: 1 new record ('' deletes), 2 TTL ms (0: none), 3 chunk key
# base, 4 new write id ('' if inline), 5 new chunk count, 6 grace ms, 7 SHA-1 the current
# value must have ('' for any), 8 MAX_CHUNKS. Returns -1 if a new chunk is missing
# (its staging expiry passed), 0/1 whether a record existed before.
PUBLISH_LUA = """
local base, wid, n = ARGV[3], ARGV[4], tonumber(ARGV[5])
if ARGV[7] ~= '' then
  local cur = redis.pcall('GET', KEYS[1])
  if type(cur) ~= 'string' or redis.sha1hex(cur) ~= ARGV[7] then return 0 end
end
for i = 0, n - 1 do
  if redis.call('EXISTS', base .. wid .. ':' .. i) == 0 then return -1 end
end
local old = redis.pcall('GETRANGE', KEYS[1], 0, 255)
local existed = redis.call('EXISTS', KEYS[1])
local ttl = tonumber(ARGV[2])
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
elseif ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
for i = 0, n - 1 do
  if ttl > 0 then redis.call('PEXPIRE', base .. wid .. ':' .. i, ttl)
  else redis.call('PERSIST', base .. wid .. ':' .. i) end
end
if type(old) == 'string' and #old > 13 and string.sub(old, 1, 3) == 'KCR' then
  local flags = string.byte(old, 5)
  if flags % 4 >= 2 then
    local off = 14
    if flags % 8 >= 4 then off = off + 32 end
    local owid, on = string.match(string.sub(old, off), '^(%x+):(%d+):')
    on = tonumber(on)
    if owid and owid ~= wid and on <= tonumber(ARGV[8]) then
      for i = 0, on - 1 do redis.call('PEXPIRE', base .. owid .. ':' .. i, ARGV[6]) end
    end
  end
end
return existed
"""


class ForgedEntry(CorruptEntry):
    """A value whose signature is missing or wrong: planted, tampered with, or damaged."""


class Record(NamedTuple):
    """A parsed, signature-checked record; ``body`` is a view into the value read."""

    version: int
    flags: int
    size: int
    body: memoryview


@dataclass(frozen=True)
class Manifest:
    """Where the chunks of a large payload are, and what they must add up to."""

    write_id: str
    chunks: int
    stored: int
    digest: str

    def encode(self) -> bytes:
        return f"{self.write_id}:{self.chunks}:{self.stored}:{self.digest}".encode()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Manifest:
        match = _MANIFEST_RE.fullmatch(bytes(body))
        if match is None:
            raise CorruptEntry("chunk manifest is malformed")
        write_id, chunks, stored, digest = (g.decode() for g in match.groups())
        return cls(write_id, int(chunks), int(stored), digest)


def seal(name: bytes, flags: int, size: int, body: bytes, secret: bytes | None) -> bytes:
    """The record for ``body`` stored under Redis key ``name``; signed when ``secret`` is set."""
    if secret is None:
        return _HEAD.pack(MAGIC, VERSION, flags & ~SIGNED, size) + body
    head = _HEAD.pack(MAGIC, VERSION, flags | SIGNED, size)
    return head + _mac(secret, name, head, body) + body


def open_record(name: bytes, raw: bytes, secret: bytes | None) -> Record:
    """Parse a record read from key ``name``; with ``secret``, its MAC must be valid.

    Raises :class:`ForgedEntry` for a missing or wrong signature and
    :class:`CorruptEntry` for anything else that is not one of our records.
    """
    view = memoryview(raw)
    if len(view) < HEAD_SIZE:
        raise CorruptEntry(f"value of {len(view)} bytes is too short for a record")
    magic, version, flags, size = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("value is not a kernelcache record (bad magic)")
    if version != VERSION:
        raise CorruptEntry(f"record version {version} is not supported (this is {VERSION})")
    offset = HEAD_SIZE + (MAC_SIZE if flags & SIGNED else 0)
    if len(view) < offset:
        raise CorruptEntry("record truncated inside its signature")
    body = view[offset:]
    if secret is not None:
        if not flags & SIGNED:
            raise ForgedEntry("unsigned value where a secret is configured")
        expected = _mac(secret, name, view[:HEAD_SIZE], body)
        if not hmac.compare_digest(expected, bytes(view[HEAD_SIZE:offset])):
            raise ForgedEntry("value fails its HMAC-SHA256 signature")
    return Record(version, flags, size, body)


def peek(prefix: bytes) -> tuple[int, int, Manifest | None]:
    """``(flags, size, manifest or None)`` from a value's first bytes, unverified (listings)."""
    if len(prefix) < HEAD_SIZE:
        raise CorruptEntry("value is too short for a record")
    magic, version, flags, size = _HEAD.unpack_from(prefix)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry("value is not a kernelcache record of this version")
    manifest = None
    if flags & CHUNKED:
        offset = HEAD_SIZE + (MAC_SIZE if flags & SIGNED else 0)
        manifest = Manifest.decode(prefix[offset:])
    return flags, size, manifest


def _mac(secret: bytes, name: bytes, head: bytes | memoryview, body: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    mac.update(len(name).to_bytes(4, "little") + name)
    mac.update(head)
    mac.update(body)
    return mac.digest()


def digest(payload: bytes | memoryview, signed: bool) -> str:
    """Digest of a chunked payload: SHA-256 when the manifest is signed, else xxHash3-128."""
    if signed:
        return hashlib.sha256(payload).hexdigest()
    return xxhash.xxh3_128_hexdigest(payload)


# Compression ------------------------------------------------------------
_local = threading.local()
_SAMPLE = 16 << 10


def _compressor(level: int) -> Any:
    # zstd contexts are reusable but not shareable between threads.
    cache: dict[int, Any] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        import zstandard

        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return cctx


def worth_compressing(parts: Sequence[bytes], level: int) -> bool:
    """Whether samples spread over the payload shrink by at least 10 % under zstd.

    Compressing 200 MB of incompressible data only to throw the result away
    costs a quarter of a second; eight 16 KiB samples cost well under a millisecond.
    """
    total = sum(map(len, parts))
    if total <= 8 * _SAMPLE:
        return True  # small: trying it is as cheap as sampling
    samples = []
    for i in range(8):
        offset = total * (2 * i + 1) // 16  # the middle of each eighth of the payload
        for part in parts:
            if offset < len(part):
                samples.append(part[offset : offset + _SAMPLE])
                break
            offset -= len(part)
    sample = b"".join(samples)
    return len(_compressor(level).compress(sample)) < 0.9 * len(sample)


def compress(parts: Sequence[bytes], size: int, level: int) -> bytes:
    """One zstd frame (with its content size and checksum) of the joined ``parts``."""
    cobj = _compressor(level).compressobj(size=size)
    out = [cobj.compress(part) for part in parts]
    out.append(cobj.flush())
    return b"".join(out)


def decompress(frame: bytes | memoryview, size: int) -> bytes:
    """Inflate a frame that must hold exactly ``size`` bytes; anything else is corrupt."""
    import zstandard

    try:
        # Checked before inflating: a forged header must not make us allocate
        # whatever it claims (a decompression bomb).
        if zstandard.frame_content_size(frame) != size:
            raise CorruptEntry("compressed payload does not declare the recorded size")
        dctx = getattr(_local, "decompressor", None)
        if dctx is None:
            dctx = _local.decompressor = zstandard.ZstdDecompressor()
        data: bytes = dctx.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptEntry(f"compressed payload is damaged: {exc}") from exc
    if len(data) != size:
        raise CorruptEntry(f"payload inflates to {len(data)} bytes, not {size}")
    return data
