"""Entries: named binary artifacts plus JSON metadata, and their one binary format.

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
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Mapping

import xxhash

from kernelcache import _fs
from kernelcache.errors import CorruptEntry, StoreError

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, Protocol
else:
    Protocol = object  # see stores/base.py: typing stays off the launcher's hit path

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
_hash = xxhash.xxh3_128_digest


# Names that passed validate_name: every disk hit re-validates the names in the
# entry's header (a crafted file must not smuggle "../x" into Entry.path), and
# artifact names are few ("kernel.cubin", ...), so a set lookup saves ~250 ns
# per read. Bounded; plain str only (a subclass could fake __eq__/__hash__).
_VALID_NAMES: set[str] = set()
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
        _VALID_NAMES.add(name)
    return name


def _dump_meta(meta: Mapping[str, Any]) -> bytes:
    # json (and the re it imports) is imported here, not at module level: a
    # launcher hit reads artifacts and never looks at the metadata.
    import json

    if not isinstance(meta, Mapping):
        raise TypeError(f"entry meta must be a dict, not {type(meta).__name__}")
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"entry meta must be JSON-serialisable: {exc}") from exc


def _load_meta(raw: bytes) -> Any:
    import json  # see _dump_meta

    return json.loads(raw)


class Entry(Mapping[str, bytes]):
    """An immutable set of named artifacts (``name -> bytes``) plus JSON-able metadata.

    Read artifacts with ``entry[name]``; ``entry.path(name)`` gives a real file
    for loaders that need one (``dlopen``, ``cuModuleLoad``). Entries read from
    a store were verified against their checksums before being returned.
    """

    __slots__ = ("_artifacts", "_digest", "_files", "_key", "_lock", "_meta_raw")

    def __init__(
        self,
        artifacts: Mapping[str, bytes | bytearray | memoryview],
        meta: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
    ) -> None:
        if not isinstance(artifacts, Mapping):
            raise TypeError(
                f"artifacts must be a mapping of name -> bytes, not {type(artifacts).__name__}"
            )
        if len(artifacts) > MAX_ARTIFACTS:
            raise ValueError(
                f"an entry holds at most {MAX_ARTIFACTS} artifacts, not {len(artifacts)}: "
                "pack them into fewer (an archive) or split the entry"
            )
        checked: dict[str, bytes] = {}
        for name, data in artifacts.items():
            validate_name(name)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"artifact {name!r} must be bytes, not {type(data).__name__}")
            checked[name] = bytes(data)
        self._artifacts = checked
        self._meta_raw = _dump_meta(meta or {})
        if len(self._meta_raw) > MAX_META_BYTES:
            raise ValueError(f"entry meta is {len(self._meta_raw)} bytes as JSON; at most 4 GiB")
        self._key = key
        self._files: Files | None = None
        self._digest: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_verified(
        cls,
        artifacts: dict[str, bytes],
        meta_raw: bytes,
        key: str | None,
        files: Files | None = None,
        *,
        digest: str | None = None,
    ) -> Entry:
        """An entry from parts a reader has already checked (names, checksums, JSON).

        The read hot path of every byte-oriented tier: nothing is copied or
        validated again. ``artifacts`` must not be modified afterwards.
        ``digest``, when known, is :meth:`digest`'s value.
        """
        self = cls.__new__(cls)
        self._artifacts = artifacts
        self._meta_raw = meta_raw
        self._key = key
        self._files = files
        self._digest = digest
        self._lock = threading.Lock()
        return self

    def bind(self, key: str, files: Files | None = None) -> Entry:
        """This entry under ``key``, with ``path()`` files from ``files``.

        The artifacts and metadata are shared, not copied; the original is
        unchanged. A tier that stores entries as files passes its own
        :class:`Files`, so that ``path()`` of the entry it returns gives files
        inside the tier (capped, shared, verified); without one, ``path()``
        writes private copies in this process's temporary directory.
        """
        return Entry.from_verified(self._artifacts, self._meta_raw, key, files, digest=self._digest)

    @property
    def key(self) -> str | None:
        """The key this entry was stored or read under (``None`` for a new entry)."""
        return self._key

    def digest(self) -> str:
        """A content digest of names, sizes and bytes of every artifact (xxh3-128, hex).

        Computed once per entry: tiers name extracted folders by it, so a
        re-published key never changes files a loader is using.
        """
        digest = self._digest
        if digest is None:
            state = xxhash.xxh3_128()
            for name, data in self._artifacts.items():
                state.update(name.encode() + b"\0")
                state.update(len(data).to_bytes(8, "little"))
                state.update(data)
            digest = self._digest = state.hexdigest()
        return digest

    # Mapping interface -------------------------------------------------
    def __getitem__(self, name: str) -> bytes:
        try:
            return self._artifacts[name]
        except KeyError:
            raise KeyError(
                f"entry has no artifact {name!r} (it has {sorted(self._artifacts)})"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._artifacts)

    def __len__(self) -> int:
        return len(self._artifacts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self._artifacts == other._artifacts and self._meta_raw == other._meta_raw

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {len(d)} B" for n, d in self._artifacts.items())
        return f"Entry({{{sizes}}}, meta={self._meta_raw.decode()[:80]})"

    @property
    def names(self) -> list[str]:
        return list(self._artifacts)

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata, as a new dict on each access.

        Entries are shared (a memory tier hands the same one to every
        caller), so a caller changing the dict it got must not change what
        the next caller sees; use :meth:`with_meta` for a changed entry.
        """
        try:
            meta = _load_meta(self._meta_raw)
        except (ValueError, RecursionError) as exc:
            raise CorruptEntry(f"entry metadata is not JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise CorruptEntry("entry metadata is not a JSON object")
        return meta

    @property
    def nbytes(self) -> int:
        """Bytes of artifact data plus metadata (what size caps count)."""
        return sum(map(len, self._artifacts.values())) + len(self._meta_raw)

    def with_meta(self, **updates: Any) -> Entry:
        """A copy with metadata fields added or replaced."""
        return Entry(self._artifacts, {**self.meta, **updates}, key=self._key)

    # Files for loaders -------------------------------------------------
    def path(self, name: str) -> str:
        """A real file holding artifact ``name``, valid while the entry is cached.

        Entries read from a disk store give a file inside that store; others
        are written once to a private temporary directory of this process.
        """
        self[name]  # an unknown name raises KeyError here, naming the artifacts it has
        with self._lock:
            # Asked each time: the file must be checked each time (it may have
            # been evicted, altered or replaced since); Files make that cheap.
            try:
                return (self._files or _TEMP_FILES).path(self, name)
            except StoreError:
                # The tier failed or may not write (disk full, read-only): the
                # bytes in hand are verified, so a private copy serves the loader.
                return _TEMP_FILES.path(self, name)

    # Binary format -----------------------------------------------------
    def pack(self, key: str | None = None) -> bytes:
        """Serialise to the self-describing binary format (the module docstring)."""
        return b"".join(self.pack_parts(key))

    def pack_parts(self, key: str | None = None) -> list[bytes]:
        """The packed form as a list of buffers (header first), to write without joining."""
        key = key if key is not None else (self._key or "")
        key_raw = key.encode()
        table = []
        for name, data in self._artifacts.items():
            raw = name.encode()
            table.append(_NAME_LEN.pack(len(raw)) + raw + _SIZE.pack(len(data)) + _hash(data))
        table_raw = b"".join(table)
        header = b"".join(
            (
                MAGIC,
                _FIXED.pack(
                    FORMAT_VERSION,
                    0,
                    len(self._artifacts),
                    len(key_raw),
                    len(self._meta_raw),
                    len(table_raw),
                ),
                key_raw,
                self._meta_raw,
                table_raw,
            )
        )
        return [header + _hash(header), *self._artifacts.values()]

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, key: str | None = None) -> Entry:
        """Parse and verify a packed entry; any defect raises :class:`CorruptEntry`.

        With ``key``, the key recorded in the entry must match it (a file
        placed under the wrong name is corrupt, not a hit).
        """
        if isinstance(data, bytes):  # the common case: slice artifacts straight out of it
            header = parse_header(data)
            if header.total_size != len(data):
                raise CorruptEntry(
                    f"entry is {len(data)} bytes, its header says {header.total_size}"
                )
            return header.build(_no_read, key, data)
        view = memoryview(data)
        header = parse_header(view)
        if header.total_size != len(view):
            raise CorruptEntry(f"entry is {len(view)} bytes, its header says {header.total_size}")
        return header.build(lambda offset, size: bytes(view[offset : offset + size]), key)


class Header:
    """The parsed header of a packed entry: where each artifact lies."""

    __slots__ = ("data_offset", "key", "meta_raw", "table", "total_size")

    def __init__(
        self,
        key: str,
        meta_raw: bytes,
        table: list[tuple[str, int, bytes]],
        data_offset: int,
        total_size: int | None = None,
    ):
        self.key = key
        self.meta_raw = meta_raw
        self.table = table
        self.data_offset = data_offset
        if total_size is None:
            total_size = data_offset + sum(size for _, size, _ in table)
        self.total_size = total_size

    def build(
        self,
        read: Callable[[int, int], bytes],
        key: str | None,
        head: bytes = b"",
        files: Files | None = None,
    ) -> Entry:
        """Read every artifact, verify it, return the Entry (with ``files`` for ``path()``).

        An artifact that lies wholly inside ``head`` (the bytes already read
        from the start of the entry) is sliced from it; any other is read
        through ``read(offset, size)``.
        """
        if key is not None and key != self.key:
            raise CorruptEntry(f"entry was stored for key {self.key!r}, not {key!r}")
        artifacts: dict[str, bytes] = {}
        offset = self.data_offset
        inside = len(head)
        for name, size, checksum in self.table:
            end = offset + size
            blob = head[offset:end] if end <= inside else read(offset, size)
            if len(blob) != size or _hash(blob) != checksum:
                raise CorruptEntry(f"artifact {name!r} fails its checksum")
            artifacts[name] = blob
            offset = end
        return Entry.from_verified(artifacts, self.meta_raw, self.key, files)


def _prefix(view: bytes | memoryview) -> tuple[int, int, int, int]:
    """``(n_artifacts, key_len, meta_len, table_len)`` from a checked magic and version."""
    if len(view) < PREFIX_SIZE:
        raise CorruptEntry("not a kernelcache entry (bad magic or too short)")
    magic, version, _flags, count, key_len, meta_len, table_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("not a kernelcache entry (bad magic or too short)")
    if version != FORMAT_VERSION:
        raise CorruptEntry(
            f"entry format version {version} is not supported (this is {FORMAT_VERSION})"
        )
    return count, key_len, meta_len, table_len


def header_size(prefix: bytes | memoryview) -> int:
    """Total header length (checksum included) from the first PREFIX_SIZE bytes."""
    _count, key_len, meta_len, table_len = _prefix(prefix)
    return PREFIX_SIZE + key_len + meta_len + table_len + CHECK_SIZE


def parse_header(view: bytes | memoryview) -> Header:
    """Parse and checksum-verify the header at the start of ``view``.

    This runs on every hit of a byte-oriented tier, so it works on bytes (a
    memoryview's header is copied once: bytes slices and ``decode`` cost a
    third of memoryview ones) and unpacks the prefix once and each table row
    in one call.
    """
    count, key_len, meta_len, table_len = _prefix(view)
    check_at = PREFIX_SIZE + key_len + meta_len + table_len
    end = check_at + CHECK_SIZE
    if len(view) < end:
        raise CorruptEntry(f"entry truncated inside its header ({len(view)} of {end} bytes)")
    data = view if isinstance(view, bytes) else bytes(view[:end])
    if _hash(data[:check_at]) != data[check_at:end]:
        raise CorruptEntry("entry header fails its checksum")
    pos = PREFIX_SIZE + key_len
    try:
        key = data[PREFIX_SIZE:pos].decode()
        meta_raw = data[pos : pos + meta_len]
        pos += meta_len
        table = []
        total = end
        for _ in range(count):
            (name_len,) = _NAME_LEN.unpack_from(data, pos)
            pos += 2
            name = data[pos : pos + name_len].decode()
            pos += name_len
            size, checksum = _SIZE_SUM.unpack_from(data, pos)
            pos += _SIZE_SUM.size
            table.append((validate_name(name), size, checksum))
            total += size
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptEntry(f"entry header is malformed: {exc}") from exc
    if pos != check_at:
        raise CorruptEntry("entry header lengths are inconsistent")
    return Header(key, meta_raw, table, end, total)


def _no_read(offset: int, size: int) -> bytes:
    raise CorruptEntry(f"entry has no bytes at {offset}+{size}")  # build() slices all from head


class Files(Protocol):
    """Where ``Entry.path`` finds real files for an entry's artifacts.

    A disk tier implements it with files inside the tier; :class:`TempFiles`
    writes private copies. ``path`` returns a file that holds the artifact's
    verified bytes (checked, not assumed) and may raise
    :class:`~kernelcache.errors.StoreError`.
    """

    def path(self, entry: Entry, name: str) -> str: ...


_tmp_dir: str | None = None
_tmp_lock = threading.Lock()
_tmp_pins: dict[str, tuple[int, int, int, int, int]] = {}


class TempFiles:
    """Private copies in this process's temporary directory (removed at exit)."""

    def path(self, entry: Entry, name: str) -> str:
        return _materialize_tmp(entry, name)


_TEMP_FILES = TempFiles()


def _materialize_tmp(entry: Entry, name: str) -> str:
    """Write an artifact of a memory-only entry to this process's private temp dir."""
    global _tmp_dir
    # Deferred: only memory-only entries need them, and the launcher's hit path
    # (interpreter start-up bound) should not pay for tempfile and shutil.
    import atexit
    import shutil
    import tempfile

    with _tmp_lock:
        if _tmp_dir is None:
            _tmp_dir = tempfile.mkdtemp(prefix="kernelcache-")  # mode 0700
            # Files handed to loaders live until the process ends, not longer.
            atexit.register(shutil.rmtree, _tmp_dir, True)
        data = entry[name]
        folder = os.path.join(_tmp_dir, xxhash.xxh3_128_hexdigest(data))
        path = os.path.join(folder, name)
        if _fs.holds(path, data, _tmp_pins):
            return path
        os.makedirs(folder, mode=0o700, exist_ok=True)
        # Missing, or altered by something outside this process: (re)write it.
        _fs.write_atomic(path, data)
        return path
