"""Bundles: many packed entries in one file, to pre-warm CI runners and containers.

Layout (integers little-endian)::

    header   16  b"KCBUNDLE", version u16, flags u16, reserved u32
    records       b"E", length u64, one packed entry (kernelcache.entry format)
    trailer  25   b"T", count u64, xxh3_128 of every byte before the checksum

Each entry carries its own key and checksums; the trailer proves the bundle
is complete (a truncated file has none) and unaltered. :func:`import_bundle`
reads a bundle once (from a file or a pipe), verifies all of it, and only
then imports it, from the very bytes it verified: all or nothing.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO

import xxhash

from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, KernelCacheError, ReadOnlyStoreError, StoreError
from kernelcache.stores.base import Store, validate_key

if TYPE_CHECKING:
    from kernelcache.cache import Cache

MAGIC = b"KCBUNDLE"
VERSION = 1
_HEADER = struct.Struct("<8sHHI")
_LENGTH = struct.Struct("<Q")
_RECORD = b"E"
_TRAILER = b"T"
_CHECK_SIZE = 16
_CHUNK = 1 << 20
#: A bundle file at least this large with under 1/64 of its bytes allocated is sparse.
_SPARSE_MIN = 1 << 20


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
    """Reads a bundle record by record, hashing every byte it reads.

    From a regular file every length is checked against what is left of the
    file before anything is allocated (a damaged length field must give an
    error, not an attempt to allocate exabytes), and a sparse file is refused
    (a record claiming 100 GiB over a hole would be read as zeros). From a
    pipe, bytes are read in chunks, so memory grows only with bytes received,
    and a record over ``max_record`` bytes is refused before it is read.
    """

    def __init__(self, f: BinaryIO, max_record: int | None = None) -> None:
        self._f = f
        self._hash = xxhash.xxh3_128()
        self._left: int | None = None
        self._max_record = max_record
        try:
            st = os.fstat(f.fileno())
        except (OSError, AttributeError, io.UnsupportedOperation):
            return  # not a file (a BytesIO): read as a stream
        if stat.S_ISREG(st.st_mode):
            if st.st_size >= _SPARSE_MIN and 0 < st.st_blocks * 512 < st.st_size // 64:
                raise BundleError(
                    f"bundle file is sparse ({st.st_blocks * 512} of {st.st_size} bytes "
                    "allocated): not a bundle kernelcache wrote"
                )
            self._left = st.st_size - f.tell()

    def read(self, size: int, what: str) -> bytes:
        if self._left is not None and size > self._left:
            raise BundleError(f"bundle is truncated inside {what}")
        if self._left is None and self._max_record is not None and size > self._max_record:
            raise BundleError(
                f"{what} claims {size} bytes, more than the target can store "
                f"({self._max_record}): refused before reading it"
            )
        chunks = []
        want = size
        while want > 0:
            chunk = self._f.read(min(want, _CHUNK))
            if not chunk:
                raise BundleError(f"bundle is truncated inside {what}")
            chunks.append(chunk)
            want -= len(chunk)
        data = b"".join(chunks)
        if self._left is not None:
            self._left -= size
        self._hash.update(data)
        return data

    def records(self) -> Iterator[tuple[int, bytes, Entry]]:
        """Every record's bytes and entry, verified; then the trailer is checked."""
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
            data = self.read(size, f"record {index}")
            yield index, data, _entry(data, index)
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
        for _index, _data, entry in _Reader(f).records():
            count += 1
            size += entry.nbytes
    return count, size


def entries(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """The entries of a bundle, each verified (:func:`import_bundle` imports all or nothing)."""
    with open(path, "rb") as f:
        for _index, _data, entry in _Reader(f).records():
            yield entry


class Imported:
    """What :func:`import_bundle` did."""

    __slots__ = ("added", "bytes", "conflicts", "entries", "present")

    def __init__(self) -> None:
        #: Records in the bundle, and their bytes.
        self.entries = 0
        self.bytes = 0
        #: Keys stored by the import.
        self.added = 0
        #: Keys every tier already held with the same contents.
        self.present = 0
        #: Keys a tier holds with other contents: the stored entry was kept.
        self.conflicts: list[str] = []

    def __repr__(self) -> str:
        return (
            f"Imported(entries={self.entries}, added={self.added}, present={self.present}, "
            f"conflicts={self.conflicts!r})"
        )


def import_bundle(
    source: BinaryIO,
    target: Store | Cache,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Imported:
    """Import the bundle read from ``source`` (a file or a pipe) into ``target``: all or nothing.

    ``target`` is a tier, or a Cache (its writable tiers that other processes
    see). The bundle is read once: every record is verified and spooled to
    an unnamed temporary file (in the first tier's directory), then the
    trailer is checked, and only then is anything imported, from the spooled
    bytes (so nothing read later, such as a file replaced meanwhile, can
    slip in). A key the bundle holds twice with different contents makes the
    bundle bad. A key a tier already holds with other contents is kept and
    reported in ``conflicts``.

    Raises :class:`BundleError` (bad bundle) or :class:`StoreError` (a tier
    failed, the disk filled): nothing is imported either way (what was added
    before a failure is removed again).
    """
    tiers = (
        [target]
        if isinstance(target, Store)
        else [tier for tier in target.tiers if not tier.in_process and not tier.read_only]
    )
    if not tiers or any(tier.read_only for tier in tiers):
        raise ReadOnlyStoreError(f"nowhere to import into: no writable tier in {target!r}")
    caps = [tier.max_bytes for tier in tiers]
    max_record = None if None in caps else max(c for c in caps if c is not None)
    spool_dir = next((tier.local_dir for tier in tiers if tier.local_dir is not None), None)
    import tempfile  # deferred: only imports need it

    try:
        with tempfile.TemporaryFile(dir=spool_dir) as spool:
            result = _spool(_Reader(source, max_record), spool)
            spool.seek(0)
            _import(spool, tiers, result, progress)
    except OSError as exc:  # the spool's own I/O (the disk filled): nothing was imported
        raise StoreError(
            f"cannot spool the bundle in {spool_dir or 'the temp dir'}: {exc}"
        ) from exc
    return result


def _spool(reader: _Reader, spool: BinaryIO) -> Imported:
    """Read and verify the whole bundle into ``spool``; the counts so far."""
    result = Imported()
    seen: dict[str, bytes] = {}
    for index, data, entry in reader.records():
        key = entry.key or ""
        digest = xxhash.xxh3_128_digest(data)
        if seen.setdefault(key, digest) != digest:
            raise BundleError(f"key {key} appears twice with different contents (record {index})")
        spool.write(_LENGTH.pack(len(data)) + data)
        result.entries += 1
        result.bytes += len(data)
    return result


def _import(
    spool: BinaryIO,
    tiers: list[Store],
    result: Imported,
    progress: Callable[[int, int], None] | None,
) -> None:
    added: list[tuple[Store, str]] = []
    try:
        for done in range(1, result.entries + 1):
            (size,) = _LENGTH.unpack(spool.read(_LENGTH.size))
            entry = Entry.unpack(spool.read(size))  # verified again: it costs little
            key = entry.key or ""
            stored = conflict = False
            for tier in tiers:
                existing = tier.get(key)
                if existing is None:
                    tier.put(key, entry)
                    added.append((tier, key))
                    stored = True
                elif existing != entry:
                    conflict = True
            if conflict:
                result.conflicts.append(key)
            elif stored:
                result.added += 1
            else:
                result.present += 1
            if progress is not None:
                progress(done, result.entries)
    except BaseException:
        # All or nothing. By key, not by file: another process putting one of
        # these keys meanwhile stores the same compile, so at worst a later miss.
        for tier, key in reversed(added):
            with contextlib.suppress(StoreError):
                tier.delete(key)
        raise
