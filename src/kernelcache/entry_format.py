"""The one binary format of an entry: packing, and parsing with verification.

Layout of a packed entry (all integers little-endian)::

    magic    8  b"KCENTRY\\n"
    fixed   16  version u16, flags u16, n_artifacts u16, key_len u16, meta_len u32, table_len u32
    key         key_len bytes, UTF-8
    meta        meta_len bytes, JSON (UTF-8)
    table       n_artifacts x (name_len u16, name, size u64, xxh3_128 16)
    check   16  xxh3_128 of everything above
    data        the artifacts' bytes, in table order

The header is checksummed as a whole and every artifact on its own, so a
reader can verify an entry with one pass and never returns bytes that differ
from what was packed. Nothing here can execute code: no pickle, ever.

Every byte-oriented tier (disk, SQLite, Redis) and the export bundle reads
through :func:`parse_header` and :meth:`Header.artifacts`: they run on every
hit, so they work on ``bytes`` (slices and ``decode`` of bytes cost a third
of memoryview ones) and unpack each fixed part in one call.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import xxhash

from kernelcache.errors import CorruptEntry

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

MAGIC = b"KCENTRY\n"
FORMAT_VERSION = 1
MAX_NAME_BYTES = 255
#: The format counts artifacts in 16 bits and the metadata's bytes in 32.
MAX_ARTIFACTS = 0xFFFF
MAX_META_BYTES = 0xFFFFFFFF
_FIXED = struct.Struct("<HHHHII")
_PREFIX = struct.Struct("<8sHHHHII")  # magic + fixed, unpacked in one call on the read path
_NAME_LEN = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
_SIZE_SUM = struct.Struct("<Q16s")  # a table row after its name: size, xxh3_128
PREFIX_SIZE = len(MAGIC) + _FIXED.size
CHECK_SIZE = 16
checksum = xxhash.xxh3_128_digest


# Names that passed validate_name, as str (for new entries) and by their UTF-8
# form (for reads): every read re-validates the names in the entry's header (a
# crafted file must not smuggle "../x" into Entry.path), and artifact names are
# few ("kernel.cubin", ...), so one lookup replaces decoding and checking them.
# Bounded; plain str only (a subclass could fake __eq__/__hash__).
_VALID_NAMES: set[str] = set()
_RAW_NAMES: dict[bytes, str] = {}
_VALID_NAMES_MAX = 1024


def validate_name(name: object) -> str:
    """Return ``name`` if it is a safe artifact file name, else raise ``ValueError``.

    Artifacts become files (``entry.path(name)``), so a name must be one plain
    path component: no separators, no ``.``/``..``, no NUL, at most 255 bytes,
    and valid Unicode (a lone surrogate has no UTF-8 form: no file can have it).
    """
    if type(name) is str and name in _VALID_NAMES:
        return name
    if not isinstance(name, str):
        raise ValueError(f"artifact name must be str, not {type(name).__name__}: {name!r}")
    try:
        encoded = name.encode()
    except UnicodeEncodeError:
        raise ValueError(
            f"unsafe artifact name {name!r}: it contains a lone surrogate, which cannot be "
            "part of a file name (decode the name with errors='strict' or 'replace')"
        ) from None
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(encoded) > MAX_NAME_BYTES
    ):
        raise ValueError(
            f"unsafe artifact name {name!r}: it must be one path component, not '.' or '..', "
            f"without '/', '\\\\' or NUL, and at most {MAX_NAME_BYTES} bytes"
        )
    if type(name) is str:
        if len(_VALID_NAMES) >= _VALID_NAMES_MAX:
            _VALID_NAMES.clear()
            _RAW_NAMES.clear()
        _VALID_NAMES.add(name)
        _RAW_NAMES[encoded] = name
    return name


def pack_parts(key: str, meta_raw: bytes, artifacts: Iterable[tuple[str, bytes]]) -> list[bytes]:
    """The packed form as a list of buffers (header first), to write without joining."""
    key_raw = key.encode()
    table = []
    data = []
    for name, blob in artifacts:
        raw = name.encode()
        table.append(_NAME_LEN.pack(len(raw)) + raw + _SIZE.pack(len(blob)) + checksum(blob))
        data.append(blob)
    table_raw = b"".join(table)
    fixed = _FIXED.pack(FORMAT_VERSION, 0, len(data), len(key_raw), len(meta_raw), len(table_raw))
    header = b"".join((MAGIC, fixed, key_raw, meta_raw, table_raw))
    return [header + checksum(header), *data]


class Header:
    """The parsed, verified header of a packed entry: where each artifact lies."""

    __slots__ = ("data_offset", "key", "meta_raw", "table", "total_size")

    def __init__(
        self,
        key: str,
        meta_raw: bytes,
        table: list[tuple[str, int, bytes]],
        data_offset: int,
        total_size: int,
    ):
        self.key = key
        self.meta_raw = meta_raw
        self.table = table
        self.data_offset = data_offset
        self.total_size = total_size


def _bad_prefix(view: bytes | memoryview) -> CorruptEntry:
    """Why the first PREFIX_SIZE bytes of ``view`` do not start an entry of this format."""
    if len(view) < PREFIX_SIZE or view[: len(MAGIC)] != MAGIC:
        return CorruptEntry("not a kernelcache entry (bad magic or too short)")
    (version,) = struct.unpack_from("<H", view, len(MAGIC))
    return CorruptEntry(
        f"entry format version {version} is not supported (this is {FORMAT_VERSION})"
    )


def header_size(prefix: bytes | memoryview) -> int:
    """Total header length (checksum included) from the first PREFIX_SIZE bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise _bad_prefix(prefix)
    magic, version, _flags, _count, key_len, meta_len, table_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise _bad_prefix(prefix)
    size: int = PREFIX_SIZE + key_len + meta_len + table_len + CHECK_SIZE
    return size


def _parse(data: bytes) -> tuple[str, bytes, list[tuple[str, int, bytes]], int, int]:
    """``(key, meta_raw, table, data_offset, total_size)`` of the header that ``data``
    starts with, its checksum and names verified; :class:`CorruptEntry` if it is bad.

    Runs on every hit of a byte-oriented tier: one unpack per fixed part, the
    names checked against the set of names already validated first.
    """
    if len(data) < PREFIX_SIZE:
        raise _bad_prefix(data)
    magic, version, _flags, count, key_len, meta_len, table_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise _bad_prefix(data)
    meta_at = PREFIX_SIZE + key_len
    table_at = meta_at + meta_len
    check_at = table_at + table_len
    end = check_at + CHECK_SIZE
    if len(data) < end:
        raise CorruptEntry(f"entry truncated inside its header ({len(data)} of {end} bytes)")
    if checksum(data[:check_at]) != data[check_at:end]:
        raise CorruptEntry("entry header fails its checksum")
    table = []
    total = end
    pos = table_at
    try:
        key = data[PREFIX_SIZE:meta_at].decode()
        for _ in range(count):
            name_at = pos + 2
            pos = name_at + (data[pos] | data[pos + 1] << 8)  # name_len, u16
            raw = data[name_at:pos]
            name = _RAW_NAMES.get(raw) or validate_name(raw.decode())
            size, digest = _SIZE_SUM.unpack_from(data, pos)
            pos += 24  # size u64, xxh3_128
            table.append((name, size, digest))
            total += size
    except (IndexError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptEntry(f"entry header is malformed: {exc}") from exc
    if pos != check_at:
        raise CorruptEntry("entry header lengths are inconsistent")
    return key, data[meta_at:table_at], table, end, total


def parse_header(view: bytes | memoryview) -> Header:
    """Parse and checksum-verify the header at the start of ``view`` (artifacts not read).

    A memoryview's header is copied once to bytes.
    """
    if type(view) is not bytes:
        view = bytes(view[: header_size(view)])
    return Header(*_parse(view))


def unpack_from(
    head: bytes, size: int, key: str | None, read: Callable[[int, int], bytes] | None = None
) -> tuple[str, bytes, dict[str, bytes]]:
    """``(key, meta_raw, artifacts)`` of the packed entry of ``size`` bytes that starts
    with ``head``, every part verified; :class:`CorruptEntry` if anything is wrong.

    ``key``, when given, must be the key recorded in the entry (a file placed
    under the wrong name is corrupt, not a hit). ``size`` is the entry's real
    size (a file's, a reply's): the header must agree before anything is
    read, so a forged size never allocates. An artifact that lies wholly
    inside ``head`` is sliced from it; any other is read through
    ``read(size, offset)`` (``os.pread``'s order: a file's reader is
    ``functools.partial(os.pread, fd)``) straight into the bytes handed out.
    """
    recorded, meta_raw, table, offset, total = _parse(head)
    if total != size:
        raise CorruptEntry(f"entry is {size} bytes, its header says {total}")
    if key is not None and key != recorded:
        raise CorruptEntry(f"entry was stored for key {recorded!r}, not {key!r}")
    artifacts: dict[str, bytes] = {}
    inside = len(head)
    for name, length, expected in table:
        end = offset + length
        if end <= inside:
            blob = head[offset:end]
        elif read is None:
            raise CorruptEntry(f"entry has no bytes at {offset}+{length}")
        else:
            blob = read(length, offset)
        # One pass over bytes already in hand (and in the CPU's cache).
        if len(blob) != length or checksum(blob) != expected:
            raise CorruptEntry(f"artifact {name!r} fails its checksum")
        artifacts[name] = blob
        offset = end
    return recorded, meta_raw, artifacts


def unpack(
    data: bytes | bytearray | memoryview, key: str | None
) -> tuple[str, bytes, dict[str, bytes]]:
    """:func:`unpack_from` of the whole packed entry ``data``.

    From bytes, the artifacts are sliced out of ``data``; from a buffer (a
    reply buffer, a mapped file), the header and each artifact are copied
    out of it once.
    """
    if type(data) is bytes:
        return unpack_from(data, len(data), key)
    view = memoryview(data)
    head = bytes(view[: header_size(view)])

    def read(length: int, offset: int) -> bytes:
        return bytes(view[offset : offset + length])

    return unpack_from(head, len(view), key, read)
