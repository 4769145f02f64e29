"""Entries: named binary artifacts plus JSON metadata.

An :class:`Entry` is immutable and shared (a memory tier hands the same one
to every caller). Its one binary format, used by every byte-oriented tier and
the export bundle, is :mod:`kernelcache.entry_format`; reads verify every
artifact against its checksum. Nothing here can execute code: no pickle, ever.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from kernelcache import _fs
from kernelcache.entry_format import (
    MAX_ARTIFACTS,
    MAX_META_BYTES,
    pack_parts,
    unpack,
    validate_name,
)
from kernelcache.errors import CorruptEntry, StoreError

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["KEY_RECORD", "Entry", "Files", "TempFiles", "validate_name"]

#: The metadata field holding the entry's key's fields (:mod:`kernelcache.explain`):
#: kept with the entry, left out of :attr:`Entry.meta` and of equality.
KEY_RECORD = "key_fields"
#: How :meth:`Entry.with_key_record` starts the record, written last: ``Entry.meta`` (on
#: hits) parses the metadata before it and skips the record. Inside a JSON string a quote
#: is escaped, and a record holds no objects, so the last match is the record's start.
_RECORD_AT = b'"' + KEY_RECORD.encode() + b'":{"ns":'

_locks_lock = threading.Lock()


def _dump_meta(meta: Mapping[str, Any]) -> bytes:
    if not isinstance(meta, Mapping):
        raise TypeError(f"entry meta must be a dict, not {type(meta).__name__}")
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"entry meta must be JSON-serialisable: {exc}") from exc


def _load_meta(raw: bytes) -> Any:
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
        self._lock: threading.Lock | None = None  # made by the first path() call

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
        self._lock = None  # made by the first path() call: most entries never need one
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
        if self._artifacts != other._artifacts:
            return False
        # The key's record describes how the entry was found, not what it holds.
        return self._meta_raw == other._meta_raw or self.meta == other.meta

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
        The key's record (:attr:`key_record`) is not part of it.
        """
        raw = self._meta_raw
        cut = raw.rfind(_RECORD_AT)
        if cut > 0 and raw[cut - 1 : cut] in (b",", b"{"):
            # Hits read metadata (compile_seconds, ...): the record is not parsed for them.
            try:
                head = _load_meta(raw[: cut - 1] + b"}" if cut > 1 else b"{}")
            except (ValueError, RecursionError):
                head = None
            if isinstance(head, dict) and KEY_RECORD not in head:
                return head
        meta = self._all_meta()
        meta.pop(KEY_RECORD, None)
        return meta

    @property
    def key_record(self) -> dict[str, Any] | None:
        """The fields of the key this entry was stored under (:mod:`kernelcache.explain`),
        when the process that stored it built the key; else ``None``."""
        record = self._all_meta().get(KEY_RECORD)
        return record if isinstance(record, dict) else None

    def _all_meta(self) -> dict[str, Any]:
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

    def with_key_record(self, record: Mapping[str, Any]) -> Entry:
        """A copy carrying ``record`` (``{"ns": ..., "fields": [...]}``) as its key's record,
        written after the rest of the metadata (see :data:`_RECORD_AT`)."""
        if not isinstance(record.get("ns"), str):
            raise ValueError("a key record starts with its namespace: {'ns': str, ...}")
        rest = _dump_meta(self.meta)
        ordered = {"ns": record["ns"], **{k: v for k, v in record.items() if k != "ns"}}
        tail = json.dumps(ordered, separators=(",", ":"), allow_nan=False).encode()
        entry = Entry(self._artifacts, key=self._key)
        entry._meta_raw = (
            rest[:-1] + (b"," if len(rest) > 2 else b"") + _RECORD_AT[:-6] + tail + b"}"
        )
        return entry

    def with_meta(self, **updates: Any) -> Entry:
        """A copy with metadata fields added or replaced (the key's record kept)."""
        return Entry(self._artifacts, {**self._all_meta(), **updates}, key=self._key)

    # Files for loaders -------------------------------------------------
    def path(self, name: str) -> str:
        """A real file holding artifact ``name``, valid while the entry is cached.

        Entries read from a disk store give a file inside that store; others
        are written once to a private temporary directory of this process.
        """
        self[name]  # an unknown name raises KeyError here, naming the artifacts it has
        with self._lock or self._make_lock():
            # Asked each time: the file must be checked each time (it may have
            # been evicted, altered or replaced since); Files make that cheap.
            try:
                return (self._files or _TEMP_FILES).path(self, name)
            except StoreError:
                # The tier failed or may not write (disk full, read-only): the
                # bytes in hand are verified, so a private copy serves the loader.
                return _TEMP_FILES.path(self, name)

    def _make_lock(self) -> threading.Lock:
        with _locks_lock:  # two threads asking at once must get the same lock
            if self._lock is None:
                self._lock = threading.Lock()
            return self._lock

    # Binary format -----------------------------------------------------
    def pack(self, key: str | None = None) -> bytes:
        """Serialise to the self-describing binary format (:mod:`kernelcache.entry_format`)."""
        return b"".join(self.pack_parts(key))

    def pack_parts(self, key: str | None = None) -> list[bytes]:
        """The packed form as a list of buffers (header first), to write without joining."""
        key = key if key is not None else (self._key or "")
        return pack_parts(key, self._meta_raw, self._artifacts.items())

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, key: str | None = None) -> Entry:
        """Parse and verify a packed entry; any defect raises :class:`CorruptEntry`.

        With ``key``, the key recorded in the entry must match it (a file
        placed under the wrong name is corrupt, not a hit).
        """
        recorded, meta_raw, artifacts = unpack(data, key)
        return cls.from_verified(artifacts, meta_raw, recorded)


class Files(Protocol):
    """Where ``Entry.path`` finds real files for an entry's artifacts.

    A disk tier implements it with files inside the tier; :class:`TempFiles`
    writes private copies. ``path`` returns a file that holds the artifact's
    verified bytes (checked, not assumed) and may raise
    :class:`~kernelcache.errors.StoreError`.
    """

    def path(self, entry: Entry, name: str) -> str: ...


_tmp_dir: list[str] = []
_tmp_lock = threading.Lock()


def private_dir() -> str:
    """This process's private temporary folder (mode 0700), made on first use, removed at exit.

    For files this process alone reads: artifacts handed to loaders, files a
    compiler writes for it. They live until the process ends, not longer.
    """
    with _tmp_lock:
        if not _tmp_dir:
            _tmp_dir.append(tempfile.mkdtemp(prefix="kernelcache-"))
            atexit.register(_remove_private_dir, _tmp_dir[0], os.getpid())
        return _tmp_dir[0]


def _remove_private_dir(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked child exiting normally leaves its parent's folder
        shutil.rmtree(folder, ignore_errors=True)


_tmp_pins: dict[str, tuple[int, int, int, int, int]] = {}


class TempFiles:
    """Private copies in this process's temporary directory (removed at exit)."""

    def path(self, entry: Entry, name: str) -> str:
        return _materialize_tmp(entry, name)


_TEMP_FILES = TempFiles()


def _materialize_tmp(entry: Entry, name: str) -> str:
    """Write an artifact of a memory-only entry to this process's private temp dir."""
    root = private_dir()
    with _tmp_lock:
        data = entry[name]
        folder = os.path.join(root, xxhash.xxh3_128_hexdigest(data))
        path = os.path.join(folder, name)
        if _fs.holds(path, data, _tmp_pins):
            return path
        os.makedirs(folder, mode=0o700, exist_ok=True)
        # Missing, or altered by something outside this process: (re)write it.
        _fs.write_atomic(path, data)
        return path
