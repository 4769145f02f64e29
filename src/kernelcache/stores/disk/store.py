"""Local-directory tier: entries published atomically, LRU under size caps.

An entry is a file of its own, or, when small and on a local filesystem, a
record in its shard's pack (:mod:`.pack`). Concurrency contract: readers see
either no entry or a complete one (staging file, then one ``os.replace``; or
the record appended, then its index slot), whatever happens to writers,
including SIGKILL. Not power-loss durable unless ``durable=True`` (fsync
before publish).

The store is get/put/delete and listing; where files live and which
directories are trusted is :mod:`.layout`, the tier's counter, removals and
eviction :mod:`.space` (with the LRU order in :mod:`.lru`), and the files
handed to loaders :mod:`.files`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import stat
import time
from typing import TYPE_CHECKING, Any

from kernelcache import fstype
from kernelcache._fs import write_new
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.base import (
    Counters,
    Damage,
    EntryInfo,
    FlightLock,
    Store,
    check_caps,
    validate_key,
)
from kernelcache.stores.disk.entryfile import check_entry, check_packed, info_of, read_entry
from kernelcache.stores.disk.files import Extractor
from kernelcache.stores.disk.layout import (
    NOATIME,
    OPEN_READ,
    SUFFIX,
    Layout,
    UnsafeDirectory,
    shard_of,
    shards,
    tree_size,
)
from kernelcache.stores.disk.pack import DamagedRecord, Packs, info_of_packed
from kernelcache.stores.disk.packindex import PACK_MAX
from kernelcache.stores.disk.space import LOW_WATER, Space
from kernelcache.stores.lockfile import FileFlightLock, sweep_locks

#: Staging files older than this belong to a crashed writer and are swept.
STALE_STAGING_SECONDS = 3600.0
#: Staging is swept at open, and by a put at most this often (seconds): a leftover of
#: a process of this node that is gone goes at once, anything else after an hour.
SWEEP_INTERVAL = 60.0
#: A hit refreshes the entry's mtime (its LRU clock) at most this often.
TOUCH_INTERVAL = 60.0
#: Keys whose recent mtime a store remembers (see DiskStore._remember).
_RECENT_MAX = 4096
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from typing import TypeVar

    from kernelcache.settings import Settings

    _T = TypeVar("_T")


@dataclasses.dataclass(eq=False)
class DiskCounters(Counters):
    """The disk tier also counts what it refused (symlinks and unsafe directories in its
    tree) and the changes it gave up behind another process's space lease (``busy``)."""

    refused: int = 0
    busy: int = 0


class DiskStore(Store):
    """A directory of verified entries shared safely by any number of processes.

    Caps (``max_bytes``: entry files plus extracted copies; ``max_entries``)
    hold for the whole tier: a change that goes over one evicts the least
    recently used entries of the tier down to ``LOW_WATER`` of it before it
    returns, so the tier exceeds a cap only by what is being written at that
    moment (one entry per writing thread). On a network filesystem the
    eviction runs in a thread of its own, down to ``NETWORK_LOW_WATER``, and
    the tier may stay over a cap until the next change (:mod:`.cleaner`).
    An entry larger than ``LOW_WATER * max_bytes`` is not stored (counted as
    an eviction).

    A directory that is not the user's, or is writable by others, is
    refused: the store then raises :class:`StoreError` on every use (a
    Cache treats it as a failing tier) and ``unusable`` says why.
    """

    kind = "disk"
    counters_class = DiskCounters
    counters: DiskCounters
    #: Entries packed in at most this many bytes go in their shard's pack (pack.py);
    #: 0 keeps a file per entry (tests of the file layout set it).
    pack_max: int = PACK_MAX

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
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.durable = durable
        self.layout = Layout(self.path, on_refused=self._refused)
        #: The directory's filesystem; on a network one, locks are leases and no
        #: stat is trusted across processes (see kernelcache.fstype, stores.lease).
        self.filesystem = fstype.detect(self.path)
        self.space = Space(
            self.layout,
            self._count,
            lambda: (self.max_bytes, self.max_entries),
            network=self.filesystem.network,
        )
        self.files = Extractor(
            self.layout,
            None if read_only else self.space,
            durable=durable,
            on_error=lambda: self._count("errors"),
        )
        #: Small entries' packs (pack.py): on local filesystems only, where mapping
        #: coherence and flock hold; a network filesystem keeps a file per entry.
        self.packs = (
            None
            if self.filesystem.network
            else Packs(
                self.layout, read_only=read_only, durable=durable, max_bytes=lambda: self.max_bytes
            )
        )
        self.space.packs = self.packs
        self.unusable = None
        self._entries = self.layout.entries
        # The checked shard directories hits open their entries in (layout.entries_fd).
        self._folders: Mapping[str, int] = self.layout.folders
        self._checked: set[str] = set()
        # key -> its entry file's mtime as last seen by a hit of this process (see get).
        self._recent: dict[str, float] = {}
        # How hits open entry files: without O_NOATIME once it was refused (see NOATIME).
        self._open_read = OPEN_READ | NOATIME
        self._next_sweep = 0.0
        self._open()

    @classmethod
    def from_settings(cls, settings: Settings) -> DiskStore:
        """The disk tier :class:`~kernelcache.settings.Settings` describe (dir, cap, read-only).

        The one place that maps settings to a disk tier: the default Cache and
        the launcher's disk-only hit path must open the very same store.
        """
        return cls(settings.dir, max_bytes=settings.max_bytes, read_only=settings.read_only)

    def __repr__(self) -> str:
        return f"DiskStore({self.path!r})"

    @property
    def locks_dir(self) -> str:
        return self.layout.locks

    # Setup -------------------------------------------------------------
    def _open(self) -> None:
        """Check (and make) the directory. Only an unsafe directory disables the tier: one
        that cannot be written (read-only media, a full disk) still serves reads."""
        writable = not self.read_only
        try:
            if self.layout.check_root(create=writable):
                self.layout.ensure(create=writable)
                if writable and self.filesystem.network:
                    # Every shard made now: a node that looked for one before another
                    # node made it would go on seeing it absent for as long as the
                    # client caches names (NFS lookupcache, FUSE), and miss.
                    for shard in shards():
                        with contextlib.suppress(StoreError):  # counted; made by a put later
                            self._check_shard(shard, create=True)
        except UnsafeDirectory as exc:
            self.unusable = str(exc)
            import logging  # deferred: only a refused directory needs it

            logging.getLogger("kernelcache").warning("kernelcache: %s; the disk tier is off", exc)
            return
        except OSError as exc:
            self._count("errors")
            _say_unusable(self.path, exc)
            return
        if writable:
            # Statistics shared by the processes using this tier live here; a
            # read-only tier writes nothing into the directory, statistics included.
            self.local_dir = self.path
            self._sweep_staging()

    def _sweep_staging(self) -> None:
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL
        errors = self.layout.sweep_staging(STALE_STAGING_SECONDS)
        if errors:
            self._count("errors", errors)

    def _refused(self) -> None:
        self._count("refused")

    def _usable(self) -> None:
        if self.unusable is not None:
            self._count("errors")
            raise StoreError(self.unusable)

    def _check_shard(self, shard: str, create: bool) -> None:
        """Check a shard directory once per process (a symlink there would be followed);
        only a put makes a missing one."""
        try:
            self.layout.shard_dir(self._entries, shard, create=create)
        except OSError as exc:
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc
        if os.path.isdir(f"{self._entries}/{shard}"):  # a missing one is checked when made
            self._checked.add(shard)

    def flight_lock(self, key: str) -> FlightLock | None:
        """An ``flock`` file per key: spans this machine's processes, freed if the holder dies."""
        if self.read_only or self.unusable is not None:
            return None  # this process cannot publish here, so it cannot end anyone's wait
        validate_key(key)
        shard = shard_of(key)
        network = self.filesystem.network
        try:
            folder = self.layout.shard_dir(self.layout.locks, shard, create=True)
            # A lease's requests name its file in the open folder (Layout.folder_fd).
            dir_fd = self.layout.folder_fd(folder) if network else None
        except OSError:
            self._count("errors")
            return None
        return FileFlightLock(
            f"{folder}/{key}.lock",
            on_error=lambda: self._count("errors"),
            leases=network,
            after_lease=functools.partial(self._revalidate, key) if network else None,
            dir_fd=dir_fd,
        )

    def _revalidate(self, key: str) -> None:
        """Make this node see ``key``'s entry if another node published it since our miss.

        On NFS (``lookupcache``) and FUSE, the name's absence is cached from our
        first miss for as long as attributes are: the lookup after the lock would
        miss and compile again (a miss leads to a compile: these round trips are
        nothing next to it). An ``open`` with ``O_CREAT`` is answered by the
        server: it opens the entry if it is there; if not, the empty file it made
        (never an entry: not counted) is removed again (:meth:`Space.probe`).
        """
        try:
            self.space.probe(key)
        except (OSError, StoreError):  # StoreError: a shard folder refused (UnsafeDirectory)
            self._count("errors")  # the lookup then misses, as it would have

    def stats(self) -> dict[str, Any]:
        """Counters, identity, and the filesystem the directory is on (``nfs4 (network)``)."""
        return {**super().stats(), "filesystem": str(self.filesystem)}

    # Reads -------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self._read(key, retry=True)

    def _read(self, key: str, retry: bool) -> Entry | None:
        # Validated up front: a key like "../../x" would otherwise read, and if
        # corrupt remove, a file outside the cache directory.
        validate_key(key)
        shard = shard_of(key)
        if self.packs is not None and self.unusable is None:
            entry = self._read_packed(key, shard)
            if entry is not None:
                return entry
        folder = self._folders.get(shard)
        if folder is None:
            self._usable()
            folder = self._guard(lambda: self.layout.entries_fd(shard))
            if folder is None:  # nothing was ever put in this shard
                return self._missed(key, shard)
        try:
            fd = os.open(key + SUFFIX, self._open_read, dir_fd=folder)
        except FileNotFoundError:
            return self._missed(key, shard)
        except OSError as exc:
            if exc.errno == errno.EPERM and self._open_read != OPEN_READ:
                # A file of another owner (a cache directory of root's that users read).
                self._open_read = OPEN_READ
                return self._read(key, retry)
            if exc.errno != errno.ESTALE:
                self._unreadable(exc)
                return None
            # NFS: the name was renamed over by another client since we looked it up.
            # One retry opens whatever the name holds now.
            return self._retry(key, retry)
        try:
            now = time.time()
            if now - self._recent.get(key, 0.0) <= TOUCH_INTERVAL:
                # Its mtime is known to be recent: the LRU clock needs no check,
                # and a small entry needs no fstat (read_entry reads its size).
                entry, size = read_entry(fd, None, key, self.files)
            else:
                st = os.fstat(fd)
                entry, size = read_entry(fd, st, key, self.files)
                self._remember(key, self._touch(fd, st.st_mtime, now))
        except CorruptEntry:
            again, size = self._reread(key, fd)
            if again is None:
                return None
            entry = again
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                return self._retry(key, retry)
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc
        finally:
            os.close(fd)
        counters = self.counters
        counters.hits += 1
        counters.bytes_read += size
        return entry

    def _read_packed(self, key: str, shard: str) -> Entry | None:
        """``key``'s packed entry (pack.py), verified; ``None`` if it is not packed here. A
        record that fails verification is a counted miss, removed if it is still there."""
        assert self.packs is not None
        try:
            found = self.packs.read(key, shard, TOUCH_INTERVAL)
        except DamagedRecord as exc:
            self._count("corrupt")
            if not self.read_only:  # the record read, never one published since
                try:
                    self.space.remove_damaged(key, exc.offset)
                except OSError:  # read-only media: left, found again (as _corrupt does)
                    self._count("errors")
            return None
        except (OSError, ValueError):  # ValueError: a mapping closed by close() meanwhile
            self._count("errors")  # the file path is tried next, as before packing
            return None
        if found is None:
            return None
        recorded, meta_raw, artifacts, size = found
        counters = self.counters
        counters.hits += 1
        counters.bytes_read += size
        return Entry.from_verified(artifacts, meta_raw, recorded, self.files)

    def _missed(self, key: str, shard: str) -> Entry | None:
        """A miss, unless the shard's pack was made or compacted by another process since
        this one opened it (one ``stat``, on misses only): then the key is looked up again."""
        if self.packs is not None and self.unusable is None and self.packs.stale(shard):
            entry = self._read_packed(key, shard)
            if entry is not None:
                return entry
        self.counters.misses += 1
        return None

    def _retry(self, key: str, retry: bool) -> Entry | None:
        """Read ``key`` once more after ``ESTALE``; a second failure is a counted miss."""
        self._count("errors")
        if retry:
            return self._read(key, retry=False)
        self.counters.misses += 1
        return None

    def _reread(self, key: str, fd: int) -> tuple[Entry | None, int]:
        """The entry in ``fd`` read once more, with its real size, before it is judged
        corrupt: a short read (a network filesystem's) is not damage, and must not
        remove a good entry. ``(None, 0)`` (counted, removed) if it is damaged."""
        try:
            st = os.fstat(fd)
            if st.st_size == 0 and self.filesystem.network:
                self.counters.misses += 1  # another leader's lookup probe (_revalidate): no entry
                return None, 0
            return read_entry(fd, st, key, self.files)
        except CorruptEntry:
            self._corrupt(key, fd)
        except OSError:
            self._count("errors")
            self.counters.misses += 1
        return None, 0

    def _touch(self, fd: int, mtime: float, now: float) -> float:
        """Move the entry open as ``fd`` up the LRU order if its ``mtime`` is older than
        TOUCH_INTERVAL (rate-limited so that hits stay read-only I/O); its mtime after."""
        if self.read_only or now - mtime <= TOUCH_INTERVAL:
            return mtime
        os.utime(fd)
        return now

    def _remember(self, key: str, mtime: float) -> None:
        """Note that ``key``'s entry file has ``mtime``: until it is TOUCH_INTERVAL old,
        hits of this process skip the LRU check (another process's touch only makes
        it newer; a replacing put too)."""
        recent = self._recent
        if len(recent) >= _RECENT_MAX:
            recent.clear()  # forgetting costs one fstat per key, nothing more
        recent[key] = mtime

    def _corrupt(self, key: str, fd: int) -> None:
        """Count the entry open as ``fd`` corrupt and remove that very file (not a
        replacement published since)."""
        self._count("corrupt")
        self.counters.misses += 1
        self._recent.pop(key, None)
        if not self.read_only:
            try:
                ino = os.fstat(fd).st_ino
                self.space.remove(key, expect_ino=ino)
            except OSError:
                self._count("errors")  # left in place: the next reader finds it again

    def _unreadable(self, exc: OSError) -> None:
        """Count a miss for a link where an entry belongs (never followed); raise otherwise."""
        if exc.errno == errno.ELOOP:
            self._count("refused")
            self.counters.misses += 1
            return
        self._count("errors")
        raise StoreError(f"disk tier {self.path}: {exc}") from exc

    # Writes ------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> Entry:
        validate_key(key)
        self._check_writable()
        self._usable()
        parts = entry.pack_parts(key)
        size = sum(map(len, parts))
        if self.max_bytes is not None and size > self.max_bytes * LOW_WATER:
            # It could only stay by evicting everything else, and not even then.
            self._count("evictions")
            return entry.bind(key)
        shard = shard_of(key)
        if self.packs is not None and size <= self.pack_max:
            try:
                self.space.publish_packed(key, shard, parts, size)
            except OSError as exc:
                self._count("busy" if isinstance(exc, TimeoutError) else "errors")
                raise StoreError(f"disk tier {self.path}: cannot store {key}: {exc}") from exc
            return self._stored(key, entry, size)
        for again in (False, True):
            if shard not in self._checked:
                self._check_shard(shard, create=True)
            tmp = self.layout.staged(key[:64]) + ".tmp"
            try:
                folder, name = self.layout.at(tmp)  # one lookup, not one per folder (issue 40)
                write_new(name, parts, durable=self.durable, dir_fd=folder)
                self.space.publish(tmp, key, shard, size)
                return self._stored(key, entry, size)
            except OSError as exc:
                self.space.discard(tmp)  # it may not exist yet (open failed) or any more
                if not again and self._moved_aside(exc, tmp, shard):
                    continue  # once more, in the folders the cache's path names now
                self._count("busy" if isinstance(exc, TimeoutError) else "errors")
                raise StoreError(f"disk tier {self.path}: cannot store {key}: {exc}") from exc
        raise AssertionError("unreachable: the second try returns or raises")

    def _moved_aside(self, exc: OSError, tmp: str, shard: str) -> bool:
        """Whether a put failed because the cache directory was moved aside (or removed) and
        made again since this store opened its folders: the staged file was written in the
        old staging folder, and renamed by path in the new tree (ENOENT). Its open folders
        are then forgotten, so that a second try uses what the path names now. Asked on a
        failure only: a put that works pays nothing for it."""
        if not isinstance(exc, FileNotFoundError):
            return False
        try:
            moved = self.layout.forget_moved(tmp, renamed=True)
        except OSError:
            return False
        if moved:
            self._checked.discard(shard)
        return moved

    def _stored(self, key: str, entry: Entry, size: int) -> Entry:
        self._count("puts")
        self._count("bytes_written", size)
        if time.monotonic() >= self._next_sweep:  # what a process of this node left (issue 40)
            self._sweep_staging()
        # path() of what the caller keeps (often a memory tier too) gives files
        # inside this tier, capped and shared, not copies in a temp directory.
        return entry.bind(key, self.files)

    def delete(self, key: str) -> bool:
        validate_key(key)
        self._check_writable()
        self._usable()
        removed = self._guard(lambda: self.space.remove(key))
        if removed:
            self._count("deletes")
        return removed

    def remove_if_unchanged(self, info: EntryInfo) -> bool:
        """Remove the entry ``info`` (from :meth:`scan` or :meth:`info`) describes.

        Stat-guarded like eviction: if the key was re-published since ``info``
        was taken, the newer entry survives and ``False`` is returned.
        """
        self._check_writable()
        self._usable()
        ino = info.extra.get("ino")
        # A packed entry is named by its last use (a compaction moves its record, and keeps
        # that): one used or replaced since the listing stays, as a replaced file does.
        clock = info.extra.get("clock_ns")
        removed = self._guard(lambda: self.space.remove(info.key, ino, None, clock))
        if removed:
            self._count("deletes")
        return removed

    def _guard(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``, turning OS errors into a counted StoreError."""
        try:
            return fn()
        except OSError as exc:
            self._count("errors")
            raise StoreError(f"disk tier {self.path}: {exc}") from exc

    # Listing -----------------------------------------------------------
    def keys(self) -> Iterator[str]:
        for info in self.scan():
            yield info.key

    def scan(self) -> Iterator[EntryInfo]:
        """Every entry; ``size`` counts its file and its extracted copies (as the cap does),
        ``extra`` has the file's ``path`` and ``ino`` and the copies' bytes (``extracted``)."""
        self._usable()
        for shard in shards():
            found, _orphans = self._guard(functools.partial(self.space.scan, shard))
            for f in found:
                if f.st is None:
                    yield info_of_packed(f, self.packs)
                else:
                    yield info_of(f.key, f.st, self.layout.entry_path(f.key, shard), f.extracted)

    def info(self, key: str) -> EntryInfo | None:
        """Size and times of one entry from its file's metadata, or ``None``."""
        validate_key(key)
        self._usable()
        packed = self._packed_info(key)
        if packed is not None:  # what a get serves, if an older file of the key is left too
            return packed
        path = self.layout.entry_path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return info_of(key, st, path, tree_size(self.layout.key_folder(key)))

    def _packed_info(self, key: str) -> EntryInfo | None:
        if self.packs is None:
            return None
        shard = shard_of(key)
        where = self._guard(lambda: self.packs.where(key, shard) if self.packs else None)
        if where is None:
            return None
        for f in self.packs.found(shard):
            if f.key == key:
                f.extracted = tree_size(self.layout.key_folder(key, shard))
                return info_of_packed(f, self.packs)
        return None

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)`` of the whole tier from its counter (cheap; exact unless a
        process was killed mid-change, which leaves it high)."""
        self._usable()
        return self._guard(lambda: self.space.usage(writable=not self.read_only))

    def recount(self) -> tuple[int, int]:
        """``(entries, bytes)`` counted from the files (a full scan); the counter is set to them."""
        self._check_writable()
        self._usable()
        return self._guard(self.space.recount)

    def check(self, info: EntryInfo) -> Damage | None:
        """Verify the entry file and its extracted copies (removing nothing)."""
        self._usable()
        if info.extra.get("packed"):
            return self._guard(lambda: check_packed(self.packs, self.files, info))
        return self._guard(lambda: check_entry(self.layout, self.files, info))

    def sweep(self) -> None:
        """Remove stale lock files and staging left by crashed or killed processes."""
        self._check_writable()
        self._usable()
        sweep_locks(self.locks_dir)
        self._sweep_staging()

    def clear(self) -> int:
        self._check_writable()
        self._usable()
        removed = 0
        for shard in shards():
            found, _orphans = self._guard(functools.partial(self.space.scan, shard))
            for f in found:  # a packed entry: whatever version of it is there now
                if self._guard(functools.partial(self.space.remove, f.key, f.ino)):
                    removed += 1
        self._guard(self.space.drop_empty_packs)
        self._guard(self.space.recount)  # and extraction folders of no entry go too
        return removed

    def close(self) -> None:
        if self.space.close():
            self.layout.close()
        # else a cleaner still runs (a slow filesystem) and names its files relative to
        # the open folders: they are closed when the layout is collected, after it ends.
        if self.packs is not None:  # local filesystems only, where eviction runs inline
            self.packs.close()
        super().close()


#: Directories already named in a warning by this process.
_SAID: set[str] = set()


def _say_unusable(path: str, exc: OSError) -> None:
    """Warn once per directory that the tier cannot use it, and why (issue 20: a cache
    directory under /proc, or under a regular file, used to fail with only a counter)."""
    if path in _SAID:
        return
    _SAID.add(path)
    import logging  # deferred, as in _open

    reason = exc.strerror or type(exc).__name__
    logging.getLogger("kernelcache").warning(
        "kernelcache: cannot set up the cache directory %s (%s): nothing is cached there",
        path,
        reason,
    )
