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

This module is the store itself (layout, get/put/delete, listing, locks);
the shards' counters and eviction are in ``disk_space.py``, the extraction of
artifacts for ``Entry.path()`` in ``disk_files.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

from kernelcache._fs import unique, write_new
from kernelcache.entry import header_size, parse_header
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import (
    Damage,
    EntryInfo,
    FlightLock,
    Store,
    check_caps,
    validate_key,
)
from kernelcache.stores.disk.files import Extractor
from kernelcache.stores.disk.space import (
    LOW_WATER,
    SHARDS,
    SUFFIX,
    ShardSpace,
    entry_key,
    shard_of,
)
from kernelcache.stores.lockfile import FileFlightLock, sweep_locks

__all__ = [
    "LOW_WATER",
    "SHARDS",
    "STALE_STAGING_SECONDS",
    "SUFFIX",
    "TOUCH_INTERVAL",
    "DiskStore",
]

#: Staging files older than this belong to a crashed writer and are swept.
STALE_STAGING_SECONDS = 3600.0
#: A hit refreshes the entry's mtime (its LRU clock) at most this often.
TOUCH_INTERVAL = 60.0
#: Entries up to this size are read in one call; of larger ones, the first
#: _HEAD_READ bytes (the header, usually a few hundred bytes) come first and
#: then each artifact straight into its own buffer: copying 8 KB of a big
#: artifact twice costs more (~0.6 us at 64 KB) than it saves.
_FIRST_READ = 8192
_HEAD_READ = 2048
_OPEN_READ = os.O_RDONLY | os.O_CLOEXEC

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from typing import TypeVar

    from kernelcache.entry import Entry
    from kernelcache.settings import Settings

    _T = TypeVar("_T")


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
        *,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        read_only: bool = False,
        durable: bool = False,
    ) -> None:
        super().__init__(read_only=read_only)
        check_caps(max_bytes, max_entries)
        self.path = os.path.abspath(os.fspath(path))
        self.local_dir = self.path
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.durable = durable
        self._base = os.path.join(self.path, "v1")
        self._entries = os.path.join(self._base, "entries")
        self._files = os.path.join(self._base, "files")
        self._staging = os.path.join(self._base, "staging")
        self._shards = os.path.join(self._base, "shards")
        self.locks_dir = os.path.join(self._base, "locks")
        self._space = ShardSpace(self)
        self._extractor = Extractor(self)
        if not read_only:
            self._guard(self._create_layout)
            self._guard(self._sweep_staging)

    @classmethod
    def from_settings(cls, settings: Settings) -> DiskStore:
        """The disk tier :class:`~kernelcache.settings.Settings` describe (dir, cap, read-only).

        The one place that maps settings to a disk tier: the default Cache and
        the launcher's disk-only hit path must open the very same store.
        """
        return cls(settings.dir, max_bytes=settings.max_size, read_only=settings.readonly)

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
            f"{self.locks_dir}/{shard_of(key)}/{key}.lock", on_error=lambda: self._count("errors")
        )

    # Reads -------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        # Validated up front: a key like "../../x" would otherwise read, and if
        # corrupt remove, a file outside the cache directory.
        validate_key(key)
        shard = shard_of(key)
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
        return entry

    def _read(self, fd: int, size: int, key: str) -> Entry:
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
        return header.build(
            lambda offset, length: os.pread(fd, length, offset), key, head, self._extractor
        )

    # Writes ------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        shard = shard_of(key)
        path = self._entry_path(key, shard)
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        tmp = f"{self._staging}/{key[:64]}.{unique()}.tmp"
        try:
            write_new(tmp, parts, durable=self.durable)
            # Publish and account under the shard lock: the size replaced must be
            # the one removed, or concurrent puts and deletes of a key make the
            # counters drift (and an undercount lets the shard outgrow its cap).
            with self._space.locked(shard) as fd:
                try:
                    old: int | None = os.stat(path).st_size
                except FileNotFoundError:
                    old = None
                # A rename within one filesystem is atomic: readers see the old entry or the new.
                os.replace(tmp, path)
                self._count("puts")
                self._count("bytes_written", size)
                self._space.account_locked(
                    fd, shard, size - (old or 0), 0 if old is not None else 1
                )
        except OSError as exc:
            self._count("errors")
            # The file may not exist yet (open failed) or any more (renamed).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise StoreError(f"disk tier {self.path}: cannot store {key}: {exc}") from exc
        # path() of what the caller keeps (often a memory tier too) gives files
        # inside this tier, capped and shared, not copies in a temp directory.
        return entry.bind(key, self._extractor)

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        shard = shard_of(key)
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
        with self._space.locked(shard) as fd:
            st = self._unlink_guarded(path, expect_ino)
            if st is None:
                return False
            if folders is None:
                freed = st.st_size + self._extractor.remove(key, shard)
            else:
                freed = st.st_size + sum(self._extractor.rmtree(folder) for folder in folders)
            self._space.account_locked(fd, shard, -freed, -1)
        return True

    def _unlink_guarded(self, path: str, expect_ino: int | None) -> os.stat_result | None:
        """Unlink an entry file unless it is no longer the inode the caller decided on.

        The file is first renamed into staging (atomic), so the inode check
        looks at the very file that was taken. If another process re-published
        the key after the caller decided, that new file is linked back and
        survives; EEXIST there means an even newer entry is in place already.
        """
        trash = f"{self._staging}/trash.{unique()}"
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
            key = entry_key(item, shard)
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
        path = self._entry_path(key, shard_of(key))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return EntryInfo(
            key, st.st_size, st.st_mtime, st.st_ctime, {"ino": st.st_ino, "path": path}
        )

    def check(self, info: EntryInfo) -> Damage | None:
        """Verify the entry file itself (without removing it); see :meth:`Store.check`."""
        path = self._entry_path(info.key, shard_of(info.key))
        try:
            fd = os.open(path, _OPEN_READ | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # removed meanwhile: nothing to check
        except OSError as exc:
            return Damage(info, f"cannot be read: {exc}")
        try:
            st = os.fstat(fd)
            # Removal takes only the very file that was checked, not one published since.
            checked = EntryInfo(info.key, st.st_size, st.st_mtime, st.st_ctime, {"ino": st.st_ino})
            self._read(fd, st.st_size, info.key)
        except CorruptEntry as exc:
            return Damage(checked, str(exc))
        except OSError as exc:
            return Damage(checked, f"cannot be read: {exc}")
        finally:
            os.close(fd)
        return None

    def remove_if_unchanged(self, info: EntryInfo) -> bool:
        """Remove the entry ``info`` (from :meth:`scan` or :meth:`info`) describes.

        Stat-guarded like eviction: if the key was re-published since ``info``
        was taken, the newer entry survives and ``False`` is returned.
        """
        self._check_writable()
        shard = shard_of(info.key)
        path = self._entry_path(info.key, shard)
        ino = info.extra.get("ino")
        removed = self._guard(lambda: self._remove(path, info.key, shard, expect_ino=ino))
        if removed:
            self._count("deletes")
        return removed

    def usage(self) -> tuple[int, int]:
        """From the shard counters: cheap, exact when no writer crashed mid-put."""
        return self._space.usage()

    def clear(self) -> int:
        self._check_writable()
        removed = 0
        for i in range(SHARDS):
            shard = f"{i:x}"
            # Listed once per shard: a listing per entry made clear() quadratic
            # once entries had been extracted (16 s for 16k entries, 1 ms each).
            # A folder extracted meanwhile is an orphan the next cleaning sweeps.
            folders = self._guard(functools.partial(self._extractor.folders, shard))
            for info in list(self._scan_shard(shard)):
                path = self._entry_path(info.key, shard)
                own = folders.get(info.key, [])
                if self._guard(functools.partial(self._remove, path, info.key, shard, None, own)):
                    removed += 1
        return removed

    def sweep(self) -> None:
        """Remove stale lock files and staging left by crashed or killed processes."""
        self._check_writable()
        sweep_locks(self.locks_dir)
        self._guard(self._sweep_staging)

    def close(self) -> None:
        self._space.close()
        super().close()
