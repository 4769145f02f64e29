"""Bundles: many packed entries in one file, to pre-warm CI runners and containers.

Layout (integers little-endian)::

    header   16  b"KCBUNDLE", version u16, flags u16, reserved u32
    records       b"E", length u64, one packed entry (kernelcache.entry format)
    trailer  25   b"T", count u64, xxh3_128 of every byte before the checksum

Each entry carries its own key and checksums; the trailer proves the bundle
is complete (a truncated file has none) and unaltered. :func:`verify` reads
the whole bundle before :func:`entries` yields anything, so an importer can
refuse a damaged bundle without having imported part of it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, KernelCacheError
from kernelcache.stores.base import validate_key

MAGIC = b"KCBUNDLE"
VERSION = 1
_HEADER = struct.Struct("<8sHHI")
_LENGTH = struct.Struct("<Q")
_RECORD = b"E"
_TRAILER = b"T"
_CHECK_SIZE = 16


class BundleError(KernelCacheError):
    """A bundle file that is truncated, altered, foreign, or of another version."""


class BundleWriter:
    """Writes a bundle to a binary file object; call :meth:`finish` last."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = xxhash.xxh3_128()
        self.count = 0
        self.bytes = 0
        self._write(_HEADER.pack(MAGIC, VERSION, 0, 0))

    def _write(self, data: bytes) -> None:
        self._hash.update(data)
        self._f.write(data)

    def add(self, entry: Entry, key: str) -> None:
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        self._write(_RECORD + _LENGTH.pack(size))
        for part in parts:
            self._write(part)
        self.count += 1
        self.bytes += size

    def finish(self) -> None:
        self._write(_TRAILER + _LENGTH.pack(self.count))
        self._f.write(self._hash.digest())


class _Reader:
    """Reads a bundle record by record, hashing every byte it reads."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = xxhash.xxh3_128()
        self._left = os.fstat(f.fileno()).st_size - f.tell()

    def read(self, size: int, what: str) -> bytes:
        # Check the length against the file first: a damaged length field
        # must give an error, not an attempt to allocate exabytes.
        if size > self._left:
            raise BundleError(f"bundle is truncated inside {what}")
        data = self._f.read(size)
        if len(data) != size:
            raise BundleError(f"bundle is truncated inside {what}")
        self._left -= size
        self._hash.update(data)
        return data

    def records(self) -> Iterator[tuple[int, Entry]]:
        """Every entry, verified; then the trailer is checked."""
        magic, version, _flags, _reserved = _HEADER.unpack(self.read(_HEADER.size, "its header"))
        if magic != MAGIC:
            raise BundleError("not a kernelcache bundle (bad magic)")
        if version != VERSION:
            raise BundleError(f"bundle version {version} is not supported (this is {VERSION})")
        index = 0
        while True:
            tag = self.read(1, f"record {index}")
            if tag == _TRAILER:
                break
            if tag != _RECORD:
                raise BundleError(f"record {index} has an unknown tag {tag!r}")
            (size,) = _LENGTH.unpack(self.read(_LENGTH.size, f"record {index}"))
            yield index, _entry(self.read(size, f"record {index}"), index)
            index += 1
        (count,) = _LENGTH.unpack(self.read(_LENGTH.size, "the trailer"))
        digest = self._hash.digest()
        check = self._f.read(_CHECK_SIZE)
        if len(check) != _CHECK_SIZE:
            raise BundleError("bundle is truncated inside the trailer")
        if check != digest:
            raise BundleError("bundle checksum does not match: the file was altered")
        if count != index:
            raise BundleError(f"bundle trailer says {count} entries, found {index}")
        if self._f.read(1):
            raise BundleError("bundle has data after its trailer")


def _entry(data: bytes, index: int) -> Entry:
    try:
        entry = Entry.unpack(data)
        validate_key(entry.key)
    except (CorruptEntry, ValueError) as exc:
        raise BundleError(f"record {index} is not a valid entry: {exc}") from exc
    return entry


def verify(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Check a whole bundle; ``(entries, bytes)`` or :class:`BundleError`."""
    count = size = 0
    with open(path, "rb") as f:
        for _index, entry in _Reader(f).records():
            count += 1
            size += entry.nbytes
    return count, size


def entries(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """The entries of a bundle, each verified (run :func:`verify` first for all-or-nothing)."""
    with open(path, "rb") as f:
        for _index, entry in _Reader(f).records():
            yield entry
