"""The disk tier's shards: which files count, their size counters, and eviction.

Keys are spread over ``SHARDS`` shards by hash. Shard ``s`` has a counter file
``v1/shards/<s>`` (bytes and entries of ``entries/<s>`` and ``files/<s>``),
updated under an ``flock`` on it, so a put never scans the whole cache (as
ccache does). A shard that grows past its share of the caps is recounted from
its files and cleaned, least recently used first, down to ``LOW_WATER`` of
its share, by the writer that noticed, under the shard's lock.

Internal to :class:`~kernelcache.stores.disk.DiskStore`, which owns one
:class:`ShardSpace`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading

import xxhash

from kernelcache.stores.base import is_valid_key

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    from kernelcache.stores.disk import DiskStore

SHARDS = 16
SUFFIX = ".kce"
#: Cleaning stops when a shard is down to this fraction of its cap.
LOW_WATER = 0.9
_COUNTER = struct.Struct("<qq")  # bytes, entries
_SHARD_NAMES = tuple(f"{i:x}" for i in range(SHARDS))


def shard_of(key: str) -> str:
    """The shard (``"0"`` to ``"f"``) that ``key`` is filed under."""
    return _SHARD_NAMES[xxhash.xxh32_intdigest(key.encode()) % SHARDS]


def entry_key(item: os.DirEntry[str], shard: str) -> str | None:
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
    if not is_valid_key(key) or shard_of(key) != shard or not item.is_file(follow_symlinks=False):
        return None
    return key


def tree_size(folder: str) -> int:
    """Bytes of the files below ``folder``; a file removed meanwhile counts nothing."""
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def read_counter(fd: int) -> tuple[int, int]:
    """``(bytes, entries)`` from a shard's open counter file."""
    raw = os.pread(fd, _COUNTER.size, 0)
    if len(raw) != _COUNTER.size:
        return 0, 0  # new or damaged counter: the next cleaning recounts the shard
    size, count = _COUNTER.unpack(raw)
    return int(size), int(count)


class ShardSpace:
    """Counters, locks and cleaning of the shards of one :class:`DiskStore`.

    Caps are read from the store on each check, so changing ``max_bytes`` on
    an open store takes effect at its next put.
    """

    def __init__(self, store: DiskStore) -> None:
        self._store = store
        self._folder = store._shards
        self._counter_fds: dict[str, int] = {}
        self._shard_locks: dict[str, threading.Lock] = {}
        self._counter_pid = os.getpid()

    @contextlib.contextmanager
    def locked(self, shard: str) -> Iterator[int]:
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
                    f"{self._folder}/{shard}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
                )
                self._counter_fds[shard] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def account(self, shard: str, delta_bytes: int, delta_entries: int) -> None:
        with self.locked(shard) as fd:
            self.account_locked(fd, shard, delta_bytes, delta_entries)

    def account_locked(self, fd: int, shard: str, delta_bytes: int, delta_entries: int) -> None:
        """Add to the counters of ``shard`` (whose lock the caller holds), cleaning it if full."""
        size, count = read_counter(fd)
        size, count = max(0, size + delta_bytes), max(0, count + delta_entries)
        if self._over_cap(size, count):
            size, count = self.clean(shard)
        os.pwrite(fd, _COUNTER.pack(size, count), 0)

    def _over_cap(self, size: int, count: int, fraction: float = 1.0) -> bool:
        max_bytes, max_entries = self._store.max_bytes, self._store.max_entries
        return (max_bytes is not None and size > max_bytes / SHARDS * fraction) or (
            max_entries is not None and count > max_entries / SHARDS * fraction
        )

    def clean(self, shard: str) -> tuple[int, int]:
        """Recount a shard from the files and evict its least recently used entries.

        Called with the shard's lock held, so one process cleans a shard at a
        time; the recount also repairs counters left stale by crashed writers.
        """
        store = self._store
        extractor = store._extractor
        folders = extractor.folders(shard)
        extracted = {key: sum(map(tree_size, paths)) for key, paths in folders.items()}
        entries = []
        with os.scandir(f"{store._entries}/{shard}") as it:
            for item in it:
                key = entry_key(item, shard)
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
                extractor.rmtree(folder)
        size = sum(e[3] for e in entries)
        count = len(entries)
        entries.sort()
        for _mtime, key, ino, entry_size in entries:
            if not self._over_cap(size, count, LOW_WATER):
                break
            # The caller holds the shard lock and writes the recounted totals.
            if store._unlink_guarded(store._entry_path(key, shard), ino) is not None:
                # Not Extractor.remove: a scan of the shard's folders per evicted
                # entry made cleaning quadratic when entries had been extracted.
                # A folder extracted since the scan above is an orphan that the
                # next cleaning removes (as for a process killed mid-removal).
                for folder in folders.get(key, ()):
                    extractor.rmtree(folder)
                size -= entry_size
                count -= 1
                store._count("evictions")
        return size, count

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)`` from the counters, without taking the locks."""
        total_bytes = total_entries = 0
        for shard in _SHARD_NAMES:
            try:
                with open(f"{self._folder}/{shard}", "rb") as f:
                    size, count = read_counter(f.fileno())
            except FileNotFoundError:
                continue
            total_bytes += size
            total_entries += count
        return total_entries, total_bytes

    def close(self) -> None:
        if self._counter_pid == os.getpid():
            for fd in self._counter_fds.values():
                os.close(fd)
        self._counter_fds = {}
