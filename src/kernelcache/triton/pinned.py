"""Triton's warm hits without re-reading the cache: files verified once, then vouched for by a stat.

Triton loads a kernel from files, so every hit hands it paths (``Entry.path``).
The disk tier reads and checksums the whole entry on each hit, which is the
guarantee (never bytes that differ from what was put) and made a disk-only
warm compile 1.11-1.14x slower than Triton's ``FileCacheManager``, which only
checks that the files exist.

:class:`PinnedTier` sits in front of the disk tier and keeps the guarantee
for a fraction of the cost. The first hit of an entry in a process comes from
the disk tier (read and verified); the entry is then promoted here, where
each of its extracted files is read once and compared with the verified
bytes, and its stat signature (:func:`kernelcache._fs.signature`: device,
inode, size, mtime, ctime) is pinned. Later hits only ``stat`` the files: all
unchanged is a hit, without reading anything. A file written, replaced or
removed since has another signature: the pin is dropped, the lookup is a
miss here, and the disk tier serves (and verifies) the entry again. A file
changed within the timestamp granularity could keep its signature, so files
that are that young (:func:`kernelcache._fs.too_new`) are never pinned, as
ccache does with its manifests.

It is also why a cleared Triton directory is a cold cache: the files are gone,
so nothing here hits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from kernelcache import _fs
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import Counters, EntryInfo, Store, bound, check_caps, validate_key

Signature = tuple[int, int, int, int, int]
_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclasses.dataclass(eq=False)
class PinnedCounters(Counters):
    """The tier's counters, plus: pins dropped because a file changed; entries not pinned
    because a file was too young to vouch for its bytes; entries whose files were not
    their bytes (served from private copies instead)."""

    changed: int = 0
    young: int = 0
    refused: int = 0


class _Files:
    """``Entry.path`` for a pinned entry: the files the lookup that returned it has just checked."""

    __slots__ = ("paths",)

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths

    def path(self, entry: Entry, name: str) -> str:
        return self.paths[name]


class _Pin:
    __slots__ = ("entry", "files", "signatures", "size")

    def __init__(self, entry: Entry, verified: list[tuple[str, str, Signature]]) -> None:
        # Parsed once here, shared by the views every hit makes (Entry.bind keeps it).
        with contextlib.suppress(CorruptEntry):
            _ = entry.meta
        self.entry = entry
        self.files = _Files({name: path for name, path, _ in verified})
        self.signatures = [(path, signature) for _, path, signature in verified]
        self.size = entry.nbytes

    def intact(self) -> bool:
        """Whether every file still has the signature it had when its bytes were verified."""
        for path, pinned in self.signatures:
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                return False
            if _fs.signature(st) != pinned:
                return False
        return True


class PinnedTier(Store):
    """Entries whose extracted files this process verified, LRU under entry and byte caps.

    Concurrency: thread-safe; visible to this process only. A hit is valid as
    of its lookup: the files of the entry it returns were unchanged then.
    Entries put here whose files cannot be pinned (too young, or not the
    entry's bytes) are not kept: the next lookup goes to the tier behind.
    """

    kind = "pinned"
    in_process = True
    counters_class = PinnedCounters
    counters: PinnedCounters

    def __init__(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        super().__init__()
        check_caps(max_bytes, max_entries)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._data: OrderedDict[str, _Pin] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PinnedTier({len(self._data)} entries)"

    def get(self, key: str) -> Entry | None:
        with self._lock:
            pin = self._data.get(key)
            if pin is not None:
                self._data.move_to_end(key)
        # The stats run outside the lock: other threads' hits need not wait for them.
        if pin is None or not pin.intact():
            with self._lock:
                if pin is not None and self._data.get(key) is pin:
                    self._drop_locked(key)
                    self.counters.changed += 1
                self.counters.misses += 1
            return None
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += pin.size
        # A fresh view each time: Entry.path memoises paths and re-checks them
        # with a stat of its own, which this lookup has just done.
        return pin.entry.bind(key, pin.files)

    def put(self, key: str, entry: Entry) -> Entry:
        """Pin ``entry`` if its files verify; returns it with ``path()`` giving the pinned files."""
        validate_key(key)
        self._check_writable()
        entry = bound(entry, key)
        verified = _verify(entry)
        with self._lock:
            if key in self._data:
                self._drop_locked(key)  # a re-published key must not keep the old files pinned
            if verified == YOUNG:
                self.counters.young += 1
                return entry  # the tier behind vouches for its files until they can be pinned
            if isinstance(verified, str):
                # The tier behind handed files that are not the verified bytes
                # (altered in place, replaced by a link): private copies of the
                # bytes in hand serve instead, never those files.
                self.counters.refused += 1
                return entry.bind(key)
            pin = _Pin(entry, verified)
            self._data[key] = pin
            self._bytes += pin.size
            self.counters.puts += 1
            self.counters.bytes_written += pin.size
            self._evict_locked()
        return entry.bind(key, pin.files)

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        with self._lock:
            if key not in self._data:
                return False
            self._drop_locked(key)
            self.counters.deletes += 1
            return True

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._data))

    def scan(self) -> Iterator[EntryInfo]:
        with self._lock:
            return iter([EntryInfo(k, pin.size, 0.0) for k, pin in self._data.items()])

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._data), self._bytes

    def clear(self) -> int:
        self._check_writable()
        with self._lock:
            count = len(self._data)
            self._data.clear()
            self._bytes = 0
            return count

    def _drop_locked(self, key: str) -> None:
        self._bytes -= self._data.pop(key).size

    def _evict_locked(self) -> None:
        while self._data and (
            (self.max_entries is not None and len(self._data) > self.max_entries)
            or (self.max_bytes is not None and self._bytes > self.max_bytes)
        ):
            _, pin = self._data.popitem(last=False)
            self._bytes -= pin.size
            self.counters.evictions += 1


def _verify(entry: Entry) -> list[tuple[str, str, Signature]] | str:
    """``(name, path, signature)`` of each of ``entry``'s files, each compared with its bytes;
    else ``YOUNG`` (a file too young to vouch for its content) or ``REFUSED`` (one that is not
    the entry's bytes, or cannot be had)."""
    now = time.time_ns()
    verified: list[tuple[str, str, Signature]] = []
    young = False
    for name in entry:
        try:
            path = entry.path(name)  # extracted by the tier behind if need be
        except (StoreError, CorruptEntry, OSError):
            return REFUSED
        outcome = verified_signature(path, entry[name], now)
        if outcome == REFUSED:
            return REFUSED
        if isinstance(outcome, str):  # YOUNG
            young = True  # the others are still checked: a wrong one must not be served
        elif not young:
            verified.append((name, path, outcome))
    return YOUNG if young else verified


YOUNG = "young"
REFUSED = "refused"


def verified_signature(path: str, data: bytes, now_ns: int) -> Signature | str:
    """The stat signature of ``path`` if it holds exactly ``data`` and is old enough to vouch for
    it; ``YOUNG`` if it is too young to tell (its bytes are not read); ``REFUSED`` if it is not
    ``data``, not a regular file, a symlink, or unreadable.

    The file is read through one descriptor that refuses symlinks; it must
    keep one signature while it is read, and the path must still name it
    afterwards (a file renamed over it meanwhile is not the one we read).
    """
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return REFUSED
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode) or before.st_size != len(data):
            return REFUSED
        if _fs.too_new(before, now_ns):
            return YOUNG
        content = _read_all(fd, len(data))
        after = os.fstat(fd)
        named = os.stat(path, follow_symlinks=False)
    except OSError:
        return REFUSED
    finally:
        os.close(fd)
    signature = _fs.signature(after)
    if content != data or _fs.signature(before) != signature or _fs.signature(named) != signature:
        return REFUSED
    return signature


def _read_all(fd: int, size: int) -> bytes:
    parts = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)
