"""The bytes :class:`~kernelcache.stores.redis.RedisStore` keeps under an entry's key (version 2).

Layout of a record: the body first, then a fixed trailer (integers little-endian)::

    body        the packed entry itself (kernelcache.entry format), one zstd frame
                of it (ZSTD), or for CHUNKED the ASCII manifest
                b"<write id>:<chunk count>:<chunk size>:<payload bytes>:<payload digest>"
    mac     32  keyed BLAKE3, only when SIGNED
    size     8  length of the packed entry after decompression
    flags    1  ZSTD=1, CHUNKED=2, SIGNED=4
    version  1  2
    magic    3  b"KCR"

The body comes first so that a plain record *is* its packed entry followed by
a few bytes: a hit parses the bytes redis-py returned, with no copy but the
artifacts themselves. The MAC is keyed BLAKE3 (about 3x HMAC-SHA256 here)
with a key derived from the secret; it covers the body, the trailer and the
Redis key name, so a signed value cannot be replayed under another key.
BLAKE3 hashes one long input at full speed only when it comes first, hence
the order. A manifest's digest covers the chunks joined: BLAKE3 when signed
(the MAC then vouches for every chunk), xxHash3-128 otherwise.

Version 1 put a header in front and signed with HMAC-SHA256; its records live
under other key names (no hash tags), so this version never reads them.

Every size is checked against limits before the work it would cost: no
record longer than a chunk, no entry over ``max_entry_size``, no zstd frame
claiming more than :data:`MAX_RATIO` times its length, no manifest whose
chunk count disagrees with its sizes. Pure functions; nothing here talks to
Redis or can execute code (no pickle).
"""

from __future__ import annotations

import hmac
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from kernelcache.entry import Entry
from kernelcache.entry_format import unpack_from
from kernelcache.errors import CorruptEntry

MAGIC = b"KCR"
VERSION = 2
ZSTD, CHUNKED, SIGNED = 1, 2, 4
_TAIL = struct.Struct("<QBB3s")
TAIL_SIZE = _TAIL.size
MAC_SIZE = 32
#: A manifest record fits in this many bytes: listings read only this suffix of a value.
SUFFIX_BYTES = 256
#: Chunk sizes a writer may use, and so a reader accepts.
MIN_CHUNK_SIZE = 64 << 10
MAX_CHUNK_SIZE = 8 << 20
#: The longest value a writer ever stores at an entry key.
MAX_RECORD = MAX_CHUNK_SIZE + MAC_SIZE + TAIL_SIZE
#: zstd inflates constant data ~30,000-fold; compiled kernels, PTX and metadata
#: 2-20-fold. Writers store payloads that would shrink further uncompressed,
#: and readers refuse frames that claim more (a 32 KiB value declaring 1 GiB).
MAX_RATIO = 128
_KEY_CONTEXT = "kernelcache 2025 redis record v2 MAC key"


class ForgedEntry(CorruptEntry):
    """A value whose signature is missing or wrong: planted, tampered with, or another secret's."""


class UnverifiableEntry(CorruptEntry):
    """A signed value read by a client without the secret: not checkable, so not readable."""


class OversizedEntry(CorruptEntry):
    """A value over the reader's limits; ``deletable`` when no writer could have made it."""

    def __init__(self, message: str, *, deletable: bool) -> None:
        super().__init__(message)
        self.deletable = deletable


class OtherVersion(CorruptEntry):
    """A record of another format version: a clean miss, left to its writer."""


class Record(NamedTuple):
    """A parsed, signature-checked record; the body is ``raw[:end]``."""

    flags: int
    size: int
    end: int


class Signer:
    """Keyed BLAKE3 under a key derived from the team's secret."""

    __slots__ = ("_blake3", "_key")

    def __init__(self, secret: bytes) -> None:
        from blake3 import blake3  # the redis extra: checked when the store is made

        self._blake3 = blake3
        self._key = blake3(secret, derive_key_context=_KEY_CONTEXT).digest()

    def mac(self, name: bytes, body: Any, tail: Any) -> bytes:
        # The long body first (see the module docstring); then the fixed-size
        # trailer, the name and its length, so the split is unambiguous.
        return self.finish(self._blake3(body, key=self._key), name, tail)

    def start(self) -> Any:
        """A hasher to feed a body in pieces (a streamed object); end with :meth:`finish`."""
        return self._blake3(key=self._key)

    def finish(self, hasher: Any, name: bytes, tail: Any) -> bytes:
        """The MAC of the body fed to ``hasher``: the same bytes :meth:`mac` gives."""
        hasher.update(tail)
        hasher.update(name + len(name).to_bytes(4, "little"))
        return bytes(hasher.digest())


@dataclass(frozen=True)
class Manifest:
    """Where the chunks of a large payload are, and what they must add up to."""

    write_id: str
    chunks: int
    chunk_size: int
    stored: int
    digest: str

    def encode(self) -> bytes:
        fields = (self.write_id, self.chunks, self.chunk_size, self.stored, self.digest)
        return ":".join(map(str, fields)).encode()

    @classmethod
    def decode(cls, body: bytes) -> Manifest:
        parts = body.split(b":")
        if len(parts) != 5 or len(body) > SUFFIX_BYTES:
            raise CorruptEntry("chunk manifest is malformed")
        write_id, digest = parts[0].decode("ascii", "replace"), parts[4].decode("ascii", "replace")
        numbers = parts[1:4]
        if (
            len(write_id) != 32
            or not _is_hex(write_id)
            or not 32 <= len(digest) <= 64
            or not _is_hex(digest)
            or not all(n.isdigit() and len(n) <= 15 for n in numbers)
        ):
            raise CorruptEntry("chunk manifest is malformed")
        chunks, chunk_size, stored = map(int, numbers)
        return cls(write_id, chunks, chunk_size, stored, digest)

    def check(self, max_entry_size: int) -> None:
        """Refuse a manifest out of bounds before a single chunk is fetched."""
        if self.stored > max_entry_size:
            raise OversizedEntry(
                f"manifest claims {self.stored} bytes, over max_entry_size", deletable=False
            )
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise CorruptEntry(f"manifest chunk size {self.chunk_size} is out of bounds")
        if self.chunks != -(-self.stored // self.chunk_size) or self.chunks < 1:
            raise CorruptEntry(
                f"manifest claims {self.chunks} chunks for {self.stored} bytes "
                f"of {self.chunk_size}-byte chunks"
            )


def _is_hex(text: str) -> bool:
    return not text.strip("0123456789abcdef")


def seal(name: bytes, flags: int, size: int, body: bytes, signer: Signer | None) -> bytes:
    """The record for ``body`` stored under Redis key ``name``; signed when ``signer`` is set."""
    flags = flags | SIGNED if signer is not None else flags & ~SIGNED
    tail = _TAIL.pack(size, flags, VERSION, MAGIC)
    if signer is None:
        return body + tail
    return b"".join((body, signer.mac(name, body, tail), tail))


def trailer(size: int, flags: int) -> bytes:
    """The fixed trailer of a record of a ``size``-byte entry (a streamed writer's last bytes)."""
    return _TAIL.pack(size, flags, VERSION, MAGIC)


def read_trailer(tail: bytes) -> tuple[int, int]:
    """``(size, flags)`` of a record's last :data:`TAIL_SIZE` bytes, magic and version checked."""
    size, flags, version, magic = _TAIL.unpack_from(tail)
    if magic != MAGIC:
        raise CorruptEntry("value is not a kernelcache record (bad magic)")
    if version != VERSION:
        raise OtherVersion(f"record version {version} is not this one ({VERSION})")
    return int(size), int(flags)


def open_record(name: bytes, raw: bytes | bytearray, signer: Signer | None) -> Record:
    """Parse a record read from key ``name``; with ``signer``, its MAC must be valid.

    Raises :class:`ForgedEntry` for a missing or wrong signature,
    :class:`UnverifiableEntry` for a signed value without a signer,
    :class:`OtherVersion` and :class:`CorruptEntry` for anything else.
    """
    n = len(raw)
    if n < TAIL_SIZE:
        raise CorruptEntry(f"value of {n} bytes is too short for a record")
    size, flags, version, magic = _TAIL.unpack_from(raw, n - TAIL_SIZE)
    if magic != MAGIC:
        raise CorruptEntry("value is not a kernelcache record (bad magic)")
    if version != VERSION:
        raise OtherVersion(f"record version {version} is not this one ({VERSION})")
    end = n - TAIL_SIZE - (MAC_SIZE if flags & SIGNED else 0)
    if end < 0:
        raise CorruptEntry("record truncated inside its signature")
    if signer is None:
        if flags & SIGNED:
            raise UnverifiableEntry("signed value, and this client has no secret to check it")
    elif not flags & SIGNED:
        raise ForgedEntry("unsigned value where a secret is configured")
    else:
        view = memoryview(raw)
        expected = signer.mac(name, view[:end], view[n - TAIL_SIZE :])
        if not hmac.compare_digest(expected, view[end : end + MAC_SIZE]):
            raise ForgedEntry("value fails its keyed BLAKE3 signature")
    return Record(flags, size, end)


def check_size(record: Record, stored: int, max_entry_size: int) -> None:
    """Refuse a payload of ``stored`` bytes whose declared ``size`` costs too much to open."""
    if record.size > max_entry_size:
        raise OversizedEntry(
            f"record claims {record.size} bytes, over max_entry_size", deletable=False
        )
    if record.flags & ZSTD:
        if record.size > stored * MAX_RATIO:
            raise OversizedEntry(
                f"a {stored}-byte zstd frame claims {record.size} bytes "
                f"(over {MAX_RATIO}x: a decompression bomb)",
                deletable=True,
            )
    elif record.size != stored:
        raise CorruptEntry(f"payload is {stored} bytes, the record says {record.size}")


def unpack_prefix(raw: bytes, end: int, key: str) -> Entry:
    """The entry packed in ``raw[:end]``, verified, sliced straight out of ``raw``."""
    recorded, meta_raw, artifacts = unpack_from(raw, end, key)
    return Entry.from_verified(artifacts, meta_raw, recorded)


def peek(suffix: bytes) -> tuple[int, int, Manifest | None]:
    """``(flags, size, manifest or None)`` from a value's last bytes, unverified (listings)."""
    if len(suffix) < TAIL_SIZE:
        raise CorruptEntry("value is too short for a record")
    size, flags, version, magic = _TAIL.unpack_from(suffix, len(suffix) - TAIL_SIZE)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry("value is not a kernelcache record of this version")
    manifest = None
    if flags & CHUNKED:
        end = len(suffix) - TAIL_SIZE - (MAC_SIZE if flags & SIGNED else 0)
        manifest = Manifest.decode(suffix[: max(end, 0)])
    return flags, size, manifest


def digest(payload: bytes, signed: bool) -> str:
    """Digest of a chunked payload: BLAKE3 when the manifest is signed, else xxHash3-128."""
    if signed:
        from blake3 import blake3

        return str(blake3(payload).hexdigest())
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


def compress(parts: Sequence[bytes], size: int, level: int) -> bytes | None:
    """One zstd frame (content size, checksum) of the joined ``parts``, if worth storing.

    ``None`` when it saves under 10 %, or shrinks more than :data:`MAX_RATIO`
    allows a reader to accept (constant data: stored as it is).
    """
    cobj = _compressor(level).compressobj(size=size)
    out = [cobj.compress(part) for part in parts]
    out.append(cobj.flush())
    frame = b"".join(out)
    if len(frame) >= size * 0.9 or size > len(frame) * MAX_RATIO:
        return None
    return frame


def decompress(frame: bytes | memoryview, size: int) -> bytes:
    """Inflate a frame that must hold exactly ``size`` bytes; anything else is corrupt.

    The caller has bounded ``size`` (:func:`check_size`) before calling.
    """
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
