"""Local-directory tier: one file per entry, published atomically, LRU under size caps.

Layout under ``path``::

    v1/entries/<s>/<key>.kce      packed entries (kernelcache.entry format), s = shard 0-f
    v1/files/<s>/<key>.<tag>/     artifacts extracted for Entry.path(), one dir per entry version
    v1/shards/<s>                 bytes and entry count of shard s, updated under flock
    v1/staging/                   files being written and entries being removed
    v1/locks/<s>/<key>.lock       single-flight compile locks (flock), removed on release

Concurrency contract: readers see either no entry or a complete one (staging
file, then one ``os.replace``), whatever happens to writers, including
SIGKILL. Not power-loss durable unless ``durable=True`` (fsync before publish).
Size caps are enforced per shard, as ccache does, so a put never scans the
whole cache: a shard that grows past ``max_bytes / 16`` is cleaned by the
writer that noticed, under the shard's lock, down to 90 % of its share.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import xxhash

from kernelcache.entry import Entry, header_size, parse_header
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import (
    EntryInfo,
    FlightLock,
    Store,
    check_caps,
    is_valid_key,
    validate_key,
)
from kernelcache.stores.lockfile import FileFlightLock

SHARDS = 16
SUFFIX = ".kce"
#: Staging files older than this belong to a crashed writer and are swept.
STALE_STAGING_SECONDS = 3600.0
#: A hit refreshes the entry's mtime (its LRU clock) at most this often.
TOUCH_INTERVAL = 60.0
#: Cleaning stops when a shard is down to this fraction of its cap.
LOW_WATER = 0.9
#: Entries up to this size are read in one call; of larger ones, the first
#: _HEAD_READ bytes (the header, usually a few hundred bytes) come first and
#: then each artifact straight into its own buffer: copying 8 KB of a big
#: artifact twice costs more (~0.6 us at 64 KB) than it saves.
_FIRST_READ = 8192
_HEAD_READ = 2048
_COUNTER = struct.Struct("<qq")  # bytes, entries
_TAG_RE = re.compile(r"[0-9a-f]{16}")  # xxh3_64 hex of an extracted entry's contents
_T = TypeVar("_T")


def _unique() -> str:
    """A random name part; ``uuid`` would cost its import (and ``platform``) on every launch."""
    return os.urandom(16).hex()


_SHARD_NAMES = tuple(f"{i:x}" for i in range(SHARDS))
_OPEN_READ = os.O_RDONLY | os.O_CLOEXEC


def _shard(key: str) -> str:
    return _SHARD_NAMES[xxhash.xxh32_intdigest(key.encode()) % SHARDS]


class DiskStore(Store):
    """A directory of verified entries shared safely by any number of processes.

    Caps: ``max_bytes`` and ``max_entries`` hold within one entry per
    concurrently writing process (the slack between publishing an entry and
    accounting for it). An entry larger than ``max_bytes / 16`` cannot be kept.
    """

    kind = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int | None = None,
        max_entries: int | None = None,
        *,
        read_only: bool = False,
        durable: bool = False,
    ) -> None:
        super().__init__(read_only=read_only)
        check_caps(max_bytes, max_entries)
        self.path = os.path.abspath(os.fspath(path))
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.durable = durable
        self._base = os.path.join(self.path, "v1")
        self._entries = os.path.join(self._base, "entries")
        self._files = os.path.join(self._base, "files")
        self._staging = os.path.join(self._base, "staging")
        self._shards = os.path.join(self._base, "shards")
        self.locks_dir = os.path.join(self._base, "locks")
        self._counter_fds: dict[str, int] = {}
        self._shard_locks: dict[str, threading.Lock] = {}
        self._counter_pid = os.getpid()
        if not read_only:
            self._guard(self._create_layout)
            self._guard(self._sweep_staging)

    def __repr__(self) -> str:
        return f"DiskStore({self.path!r})"

    # Setup -------------------------------------------------------------
    def _create_layout(self) -> None:
        if os.path.isdir(self._shards):
            # Created last, so the layout is complete: skip ~35 makedirs calls
            # (~1.5 ms) on every open; the launcher opens the store per call.
            return
        if not os.path.isdir(self.path):
            # Private to the user: a shared cache directory lets others plant binaries.
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            tag = os.path.join(self.path, "CACHEDIR.TAG")
            with open(tag, "w") as f:
                f.write("Signature: 8a477f597d28d172789f06886806bc55\n# kernelcache directory\n")
        # Each level explicitly: makedirs gives intermediate directories the
        # default mode (0755), not ``mode``.
        for folder in (self._base, self._entries, self._files):
            os.makedirs(folder, mode=0o700, exist_ok=True)
        for top in (self._entries, self._files):
            for i in range(SHARDS):
                os.makedirs(os.path.join(top, f"{i:x}"), mode=0o700, exist_ok=True)
        os.makedirs(self._staging, mode=0o700, exist_ok=True)
        os.makedirs(self._shards, mode=0o700, exist_ok=True)

    def _sweep_staging(self) -> None:
        """Remove what crashed writers left in staging (older than an hour)."""
        cutoff = time.time() - STALE_STAGING_SECONDS
        with os.scandir(self._staging) as it:
            for item in it:
                try:
                    if item.stat(follow_symlinks=False).st_mtime >= cutoff:
                        continue
                    if item.is_dir(follow_symlinks=False):
                        import shutil  # deferred: off the launcher's hit path

                        shutil.rmtree(item.path)
                    else:
                        os.unlink(item.path)
                except FileNotFoundError:
                    continue  # another process swept it first

    def _guard(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``, turning OS errors into a counted StoreError."""
        try:
            return fn()
        except OSError as exc:
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc

    def _entry_path(self, key: str, shard: str) -> str:
        return f"{self._entries}/{shard}/{key}{SUFFIX}"

    def flight_lock(self, key: str) -> FlightLock | None:
        """An ``flock`` file per key: spans this machine's processes, freed if the holder dies."""
        if self.read_only:
            return None  # this process cannot publish here, so it cannot end anyone's wait
        validate_key(key)
        return FileFlightLock(
            f"{self.locks_dir}/{_shard(key)}/{key}.lock", on_error=lambda: self._count("errors")
        )

    # Reads -------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        # Validated up front: a key like "../../x" would otherwise read, and if
        # corrupt remove, a file outside the cache directory.
        validate_key(key)
        shard = _shard(key)
        path = f"{self._entries}/{shard}/{key}{SUFFIX}"  # _entry_path, inlined: the hit path
        try:
            fd = os.open(path, _OPEN_READ)
        except FileNotFoundError:
            self.counters.misses += 1
            return None
        except OSError as exc:
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            entry = self._read(fd, st.st_size, key)
            if not self.read_only and time.time() - st.st_mtime > TOUCH_INTERVAL:
                os.utime(fd)  # the LRU clock; rate-limited so hits stay read-only I/O
        except CorruptEntry:
            self._count("corrupt")
            self.counters.misses += 1
            if not self.read_only:
                self._guard(lambda: self._remove(path, key, shard, expect_ino=st.st_ino))
            return None
        except OSError as exc:
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc
        finally:
            os.close(fd)
        self.counters.hits += 1
        self.counters.bytes_read += st.st_size
        entry._materialize = self._materialize
        return entry

    @staticmethod
    def _read(fd: int, size: int, key: str) -> Entry:
        head = os.pread(fd, size if size <= _FIRST_READ else _HEAD_READ, 0)
        if len(head) < size:  # only part of the file was read: the header may reach further
            need = header_size(head)
            if len(head) < need <= size:
                head = os.pread(fd, need, 0)
        header = parse_header(head)
        if header.total_size != size:
            raise CorruptEntry(f"entry file is {size} bytes, its header says {header.total_size}")
        # Artifacts inside the first read are sliced from it; larger ones are
        # read straight into their own bytes object (no second copy).
        return header.build(lambda offset, length: os.pread(fd, length, offset), key, head)

    # Writes ------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> None:
        validate_key(key)
        self._check_writable()
        shard = _shard(key)
        path = self._entry_path(key, shard)
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        tmp = f"{self._staging}/{key[:64]}.{_unique()}.tmp"
        try:
            self._write_file(tmp, parts)
            # Publish and account under the shard lock: the size replaced must be
            # the one removed, or concurrent puts and deletes of a key make the
            # counters drift (and an undercount lets the shard outgrow its cap).
            with self._locked(shard) as fd:
                try:
                    old: int | None = os.stat(path).st_size
                except FileNotFoundError:
                    old = None
                # A rename within one filesystem is atomic: readers see the old entry or the new.
                os.replace(tmp, path)
                self._count("puts")
                self._count("bytes_written", size)
                self._account_locked(fd, shard, size - (old or 0), 0 if old is not None else 1)
        except OSError as exc:
            self._count("errors")
            # The file may not exist yet (open failed) or any more (renamed).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise StoreError(f"disk tier {self.path}: cannot store {key}: {exc}") from exc
        if entry._materialize is None and entry.key in (None, key):
            # The caller's object (often also held by a memory tier) now has a
            # published copy here: path() should give files inside this tier,
            # capped and shared, not copies in a per-process temp directory.
            entry.key = key
            entry._materialize = self._materialize

    def _write_file(self, tmp: str, parts: list[bytes]) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        shard = _shard(key)
        removed = self._guard(lambda: self._remove(self._entry_path(key, shard), key, shard))
        if removed:
            self._count("deletes")
        return removed

    def _remove(
        self,
        path: str,
        key: str,
        shard: str,
        expect_ino: int | None = None,
        folders: Sequence[str] | None = None,
    ) -> bool:
        """Remove an entry and its extracted files, and account for the space freed.

        ``folders``: the entry's extracted folders, when the caller listed them
        already (clear() lists each shard once instead of once per entry).
        """
        with self._locked(shard) as fd:
            st = self._unlink_guarded(path, expect_ino)
            if st is None:
                return False
            if folders is None:
                freed = st.st_size + self._remove_extracted(key, shard)
            else:
                freed = st.st_size + sum(self._rmtree_atomic(folder) for folder in folders)
            self._account_locked(fd, shard, -freed, -1)
        return True

    def _unlink_guarded(self, path: str, expect_ino: int | None) -> os.stat_result | None:
        """Unlink an entry file unless it is no longer the inode the caller decided on.

        The file is first renamed into staging (atomic), so the inode check
        looks at the very file that was taken. If another process re-published
        the key after the caller decided, that new file is linked back and
        survives; EEXIST there means an even newer entry is in place already.
        """
        trash = f"{self._staging}/trash.{_unique()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return None
        st = os.lstat(trash)
        if expect_ino is not None and st.st_ino != expect_ino:
            # EEXIST: a newer entry was published meanwhile; it stays.
            with contextlib.suppress(FileExistsError):
                os.link(trash, path)
            os.unlink(trash)
            return None
        os.unlink(trash)
        return st

    # Files for loaders -------------------------------------------------
    def _materialize(self, entry: Entry, name: str) -> str:
        key = entry.key or ""
        shard = _shard(key)
        # All artifacts of an entry share one folder: once one path is known,
        # so is the folder. Re-hashing every artifact for each name made n
        # path() calls cost n^2 (~140 us for a 7-file Triton group).
        known = next(iter(entry._paths.values()), None)
        if known is not None:
            folder = os.path.dirname(known)
        else:
            digest = xxhash.xxh3_64()
            for n, data in entry.items():
                digest.update(n.encode() + b"\0" + len(data).to_bytes(8, "little"))
                digest.update(data)
            folder = f"{self._files}/{shard}/{key}.{digest.hexdigest()}"
        target = os.path.join(folder, name)

        def extract() -> None:
            try:
                if os.path.getsize(target) == len(entry[name]):
                    return
            except FileNotFoundError:
                pass  # not extracted yet
            self._extract(entry, folder, shard)

        self._guard(extract)  # other OS errors: a broken tier, counted
        return target

    def _extract(self, entry: Entry, folder: str, shard: str) -> None:
        if os.path.isdir(folder):
            if _is_complete(folder, entry):
                # Another thread or process extracted it since the caller looked;
                # removing it would pull the file from under a loader using it.
                return
            freed = self._rmtree_atomic(folder)  # damaged (a file missing or cut): redo it
            self._account(shard, -freed, 0)
        staging = f"{self._staging}/extract.{_unique()}"
        os.mkdir(staging, 0o700)
        for name, data in entry.items():
            self._write_file(os.path.join(staging, name), [data])
        try:
            os.rename(staging, folder)
        except OSError as exc:
            import shutil  # deferred: off the launcher's hit path

            shutil.rmtree(staging)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return  # benign race: another process extracted the same entry first
        self._account(shard, sum(map(len, entry.values())), 0)

    def _extracted_folders(self, shard: str) -> dict[str, list[str]]:
        """Every extracted folder of a shard, by key (one listing of files/<shard>)."""
        folders: dict[str, list[str]] = {}
        with os.scandir(f"{self._files}/{shard}") as it:
            for item in it:
                key = _extracted_key(item)
                if key is not None:  # else foreign: neither counted nor touched
                    folders.setdefault(key, []).append(item.path)
        return folders

    def _remove_extracted(self, key: str, shard: str) -> int:
        freed = 0
        # An exact match: a prefix test would also take key "a.b"'s files for key "a".
        with os.scandir(f"{self._files}/{shard}") as it:
            folders = [item.path for item in it if _extracted_key(item) == key]
        for folder in folders:
            freed += self._rmtree_atomic(folder)
        return freed

    def _rmtree_atomic(self, folder: str) -> int:
        trash = f"{self._staging}/trash.{_unique()}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return 0
        size = _tree_size(trash)
        import shutil  # deferred: off the launcher's hit path

        shutil.rmtree(trash)
        return size

    # Size accounting and eviction -------------------------------------
    @contextlib.contextmanager
    def _locked(self, shard: str) -> Iterator[int]:
        """Hold shard ``shard`` against other threads and processes; yields its counter fd.

        flock belongs to the open file description, so threads sharing the
        descriptor are not excluded by it (hence the thread lock), and a forked
        child shares it with its parent (hence new descriptors and locks after fork).
        """
        if self._counter_pid != os.getpid():
            self._counter_fds = {}
            self._shard_locks = {}
            self._counter_pid = os.getpid()
        lock = self._shard_locks.get(shard)
        if lock is None:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock:
            fd = self._counter_fds.get(shard)
            if fd is None:
                fd = os.open(
                    f"{self._shards}/{shard}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
                )
                self._counter_fds[shard] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _account(self, shard: str, delta_bytes: int, delta_entries: int) -> None:
        with self._locked(shard) as fd:
            self._account_locked(fd, shard, delta_bytes, delta_entries)

    def _account_locked(self, fd: int, shard: str, delta_bytes: int, delta_entries: int) -> None:
        size, count = _read_counter(fd)
        size, count = max(0, size + delta_bytes), max(0, count + delta_entries)
        if self._over_cap(size, count):
            size, count = self._clean_shard(shard)
        os.pwrite(fd, _COUNTER.pack(size, count), 0)

    def _shard_caps(self) -> tuple[float | None, float | None]:
        return (
            None if self.max_bytes is None else self.max_bytes / SHARDS,
            None if self.max_entries is None else self.max_entries / SHARDS,
        )

    def _over_cap(self, size: int, count: int, fraction: float = 1.0) -> bool:
        cap_bytes, cap_entries = self._shard_caps()
        return (cap_bytes is not None and size > cap_bytes * fraction) or (
            cap_entries is not None and count > cap_entries * fraction
        )

    def _clean_shard(self, shard: str) -> tuple[int, int]:
        """Recount a shard from the files and evict its least recently used entries.

        Called with the shard's lock held, so one process cleans a shard at a
        time; the recount also repairs counters left stale by crashed writers.
        """
        folders = self._extracted_folders(shard)
        extracted = {key: sum(map(_tree_size, paths)) for key, paths in folders.items()}
        entries = []
        with os.scandir(f"{self._entries}/{shard}") as it:
            for item in it:
                key = _entry_key(item, shard)
                if key is None:
                    continue  # foreign file: neither counted nor touched
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, key, st.st_ino, st.st_size + extracted.get(key, 0)))
        live = {e[1] for e in entries}
        for key in extracted.keys() - live:  # left by a process killed mid-removal
            for folder in folders[key]:
                self._rmtree_atomic(folder)
        size = sum(e[3] for e in entries)
        count = len(entries)
        entries.sort()
        for _mtime, key, ino, entry_size in entries:
            if not self._over_cap(size, count, LOW_WATER):
                break
            # The caller holds the shard lock and writes the recounted totals.
            if self._unlink_guarded(self._entry_path(key, shard), ino) is not None:
                # Not _remove_extracted: a scan of the shard's folders per evicted
                # entry made cleaning quadratic when entries had been extracted.
                # A folder extracted since the scan above is an orphan that the
                # next cleaning removes (as for a process killed mid-removal).
                for folder in folders.get(key, ()):
                    self._rmtree_atomic(folder)
                size -= entry_size
                count -= 1
                self._count("evictions")
        return size, count

    # Listing -----------------------------------------------------------
    def keys(self) -> Iterator[str]:
        for info in self.scan():
            yield info.key

    def scan(self) -> Iterator[EntryInfo]:
        for i in range(SHARDS):
            yield from self._scan_shard(f"{i:x}")

    def _scan_shard(self, shard: str) -> Iterator[EntryInfo]:
        try:
            with os.scandir(f"{self._entries}/{shard}") as it:
                items = list(it)
        except FileNotFoundError:
            return
        for item in items:
            key = _entry_key(item, shard)
            if key is None:
                continue  # foreign files are neither listed nor touched
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield EntryInfo(
                key, st.st_size, st.st_mtime, st.st_ctime, {"ino": st.st_ino, "path": item.path}
            )

    def info(self, key: str) -> EntryInfo | None:
        """Size and times of one entry from its file's metadata, or ``None``."""
        validate_key(key)
        path = self._entry_path(key, _shard(key))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return EntryInfo(
            key, st.st_size, st.st_mtime, st.st_ctime, {"ino": st.st_ino, "path": path}
        )

    def remove_if_unchanged(self, info: EntryInfo) -> bool:
        """Remove the entry ``info`` (from :meth:`scan` or :meth:`info`) describes.

        Stat-guarded like eviction: if the key was re-published since ``info``
        was taken, the newer entry survives and ``False`` is returned.
        """
        self._check_writable()
        shard = _shard(info.key)
        path = self._entry_path(info.key, shard)
        ino = info.extra.get("ino")
        removed = self._guard(lambda: self._remove(path, info.key, shard, expect_ino=ino))
        if removed:
            self._count("deletes")
        return removed

    def usage(self) -> tuple[int, int]:
        """From the shard counters: cheap, exact when no writer crashed mid-put."""
        total_bytes = total_entries = 0
        for i in range(SHARDS):
            try:
                with open(f"{self._shards}/{i:x}", "rb") as f:
                    size, count = _read_counter(f.fileno())
            except FileNotFoundError:
                continue
            total_bytes += size
            total_entries += count
        return total_entries, total_bytes

    def clear(self) -> int:
        self._check_writable()
        removed = 0
        for i in range(SHARDS):
            shard = f"{i:x}"
            # Listed once per shard: a listing per entry made clear() quadratic
            # once entries had been extracted (16 s for 16k entries, 1 ms each).
            # A folder extracted meanwhile is an orphan the next cleaning sweeps.
            folders = self._guard(functools.partial(self._extracted_folders, shard))
            for info in list(self._scan_shard(shard)):
                path = self._entry_path(info.key, shard)
                own = folders.get(info.key, [])
                if self._guard(functools.partial(self._remove, path, info.key, shard, None, own)):
                    removed += 1
        return removed

    def close(self) -> None:
        if self._counter_pid == os.getpid():
            for fd in self._counter_fds.values():
                os.close(fd)
        self._counter_fds = {}
        super().close()


def _read_counter(fd: int) -> tuple[int, int]:
    raw = os.pread(fd, _COUNTER.size, 0)
    if len(raw) != _COUNTER.size:
        return 0, 0  # new or damaged counter: the next cleaning recounts the shard
    size, count = _COUNTER.unpack(raw)
    return int(size), int(count)


def _is_complete(folder: str, entry: Entry) -> bool:
    try:
        return all(os.path.getsize(os.path.join(folder, n)) == len(d) for n, d in entry.items())
    except FileNotFoundError:
        return False


def _tree_size(folder: str) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _entry_key(item: os.DirEntry[str], shard: str) -> str | None:
    """The key of the entry file ``item`` in shard directory ``shard``, or ``None``.

    Anything else there is foreign and must be neither listed, counted nor
    removed: other names, invalid keys, a key filed under the wrong shard, and
    directories or links named like entries (a directory made cleaning fail
    with IsADirectoryError on every put to its shard).
    """
    name = item.name
    if not name.endswith(SUFFIX):
        return None
    key = name[: -len(SUFFIX)]
    if not is_valid_key(key) or _shard(key) != shard or not item.is_file(follow_symlinks=False):
        return None
    return key


def _extracted_key(item: os.DirEntry[str]) -> str | None:
    """The key of extraction directory ``<key>.<tag>``, or ``None`` for a foreign item
    (a foreign file there made cleaning fail with NotADirectoryError)."""
    key, _, tag = item.name.rpartition(".")
    if _TAG_RE.fullmatch(tag) is None or not is_valid_key(key):
        return None
    return key if item.is_dir(follow_symlinks=False) else None
