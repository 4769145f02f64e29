"""Where the disk tier keeps what, and the checks that keep others out of it.

Layout under the cache directory ``root``::

    v1/entries/<s>/<key>.kce          packed entries (kernelcache.entry format), s = shard 0-f
    v1/extracted/<s>/<key>/<tag>/     artifacts extracted for Entry.path(), tag = content digest
    v1/space                          bytes and entries of the whole tier (see space.py)
    v1/lru/<s>                        least-recently-used queue of shard s (see lru.py)
    v1/staging/                       files being written and entries being removed,
                                      named with their writer (node and pid) for the sweep
    v1/locks/<s>/<key>.lock           single-flight compile locks (flock), removed on release
    v1/packs/<s>.idx, <s>.<gen>.dat   small entries of shard s, packed (local filesystems; pack.py)

Nothing inside the tree is trusted to be what its name says: the directory
itself must belong to the user (or root) and not be writable by group or
others, as ssh demands of ``~/.ssh``; every directory the tier uses is checked
with ``lstat`` (a symlink is refused) before its first use in a process; files
are opened with ``O_NOFOLLOW``.

:class:`Layout` is the public collaborator that :mod:`~kernelcache.stores.disk.space`,
:mod:`~kernelcache.stores.disk.files` and the store share; it imports no other
module of the tier.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
from typing import TYPE_CHECKING

import xxhash

from kernelcache import _fs, _trust
from kernelcache._fs import unique
from kernelcache.errors import StoreError
from kernelcache.stores.base import is_valid_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

SHARDS = 16
SUFFIX = ".kce"
#: Length of an extraction folder's tag: hex digits of the entry's content digest.
TAG_LENGTH = 16
#: Open flags for reading a file of the tree: never through a symlink.
OPEN_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
#: Added where a hit reads an entry: under ``relatime`` (the default mount option) the
#: first read of a file written or touched since its last read writes its atime, an
#: inode update that cost ~0.9 us of a ~8 us distinct-key 4 KB hit (issue 40). Nothing
#: in the tier uses atime (the LRU clock is the mtime). Only the file's owner (or root)
#: may ask for it: ``EPERM`` otherwise, and the reader opens without it.
NOATIME = getattr(os, "O_NOATIME", 0)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
_SHARD_NAMES = tuple(f"{i:x}" for i in range(SHARDS))


#: This node (host, boot and pid namespace) as staging names carry it: a sweep on this
#: node tells a dead writer's leftover from a live one's file by its pid (issue 40).
def _pid_namespace() -> str:
    """Containers on one host (host network, so one name and boot id) see different pids:
    a pid is checked only by a process of the same pid namespace."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return "-"
    return f"{st.st_dev}:{st.st_ino}"


_NODE = (
    "n"
    + xxhash.xxh64_hexdigest(f"{os.uname().nodename} {_fs.boot_id()} {_pid_namespace()}".encode())[
        :12
    ]
)
_CACHEDIR_TAG = "Signature: 8a477f597d28d172789f06886806bc55\n# kernelcache directory\n"


class UnsafeDirectory(StoreError):
    """The cache directory (or a directory inside it) could be altered by someone else."""


def shard_of(key: str) -> str:
    """The shard (``"0"`` to ``"f"``) that ``key`` is filed under."""
    return _SHARD_NAMES[xxhash.xxh32_intdigest(key.encode()) % SHARDS]


def shards() -> tuple[str, ...]:
    return _SHARD_NAMES


def entry_key(name: str, st: os.stat_result, shard: str) -> str | None:
    """The key of the entry file ``name`` (status ``st``) in shard directory ``shard``, or ``None``.

    Anything else there is foreign and must be neither listed, counted nor
    removed: other names, invalid keys, a key filed under the wrong shard, and
    directories or links named like entries.
    """
    if not name.endswith(SUFFIX):
        return None
    key = name[: -len(SUFFIX)]
    if not is_valid_key(key) or shard_of(key) != shard or not stat.S_ISREG(st.st_mode):
        return None
    return key


def is_tag(text: str) -> bool:
    """Whether ``text`` is a folder tag, ``[0-9a-f]{16}``, checked without importing ``re``."""
    return len(text) == TAG_LENGTH and not text.strip("0123456789abcdef")


def tree_size(folder: str) -> int:
    """Bytes of the files below ``folder`` (links not followed); a file removed meanwhile counts 0."""
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def remove_tree(path: str, at: Callable[[str], tuple[int | None, str]] | None = None) -> bool:
    """Delete ``path`` (a file, a link or a folder; links are removed, never followed).

    ``False`` if something is left: an error (``EBUSY`` from a folder holding a
    file still open on another NFS client, ``EIO``) is never raised, as
    everything removed here is already out of the cache's view; what is
    left in staging is swept later.

    A file goes in one request (no ``lstat`` first: on a network filesystem each
    is a round trip, and most of what is removed here is a file; issue 40), named
    relative to its open folder when ``at`` is given (:meth:`Layout.at`).
    """
    folder, name = (None, path) if at is None else at(path)
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):  # Linux says EISDIR, POSIX EPERM
            return False
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False  # EPERM on a file: not ours to remove
        except FileNotFoundError:
            return True
        except OSError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    return True


def _left_here(name: str) -> bool:
    """Whether staging item ``name`` was written by a process of this node that is gone."""
    tag = next((p for p in name.split(".") if p.startswith(_NODE + "-")), None)
    pid = tag.partition("-")[2] if tag is not None else ""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not _fs.pid_alive(int(pid))


class Layout:
    """The paths of one cache directory, and its safety checks.

    ``on_refused`` is called for each symlink or unsafe item refused (the
    store counts them). Directories are checked once per process: a
    process that saw a directory safe keeps using it by name.
    """

    def __init__(self, root: str, on_refused: Callable[[], None] | None = None) -> None:
        self.root = root
        self.base = f"{root}/v1"
        self.entries = f"{self.base}/entries"
        self.extracted = f"{self.base}/extracted"
        self.staging = f"{self.base}/staging"
        self.lru = f"{self.base}/lru"
        self.locks = f"{self.base}/locks"
        self.space = f"{self.base}/space"
        self._on_refused = on_refused
        self._checked: set[str] = set()
        self._pid = os.getpid()
        self._folders = _Folders()
        self._open_dirs = _Folders()  # folder_fd's, by path
        self._gone = _Folders()  # folder_fd's of folders removed since (forget_moved)
        # The folders that stay for the tree's life (at() opens them; never a key's).
        self._lasting = {
            self.base,
            self.entries,
            self.extracted,
            self.staging,
            self.locks,
            self.lru,
        } | {
            f"{top}/{shard}"
            for top in (self.entries, self.extracted, self.locks)
            for shard in shards()
        }

    # Paths ---------------------------------------------------------------
    def entry_path(self, key: str, shard: str | None = None) -> str:
        return f"{self.entries}/{shard or shard_of(key)}/{key}{SUFFIX}"

    def key_folder(self, key: str, shard: str | None = None) -> str:
        """Where the extracted versions of ``key`` live (one ``<tag>`` folder each)."""
        return f"{self.extracted}/{shard or shard_of(key)}/{key}"

    def trash(self) -> str:
        """A new name in staging for something about to be deleted."""
        return f"{self.staging}/trash.{unique()}"

    def staged(self, stem: str) -> str:
        """A new name in staging for a file or folder being written, with its writer."""
        return f"{self.staging}/{stem}.{_NODE}-{os.getpid()}.{unique()}"

    def refused(self) -> None:
        if self._on_refused is not None:
            self._on_refused()

    def sweep_staging(self, older_than: float) -> int:
        """Remove what crashed writers left in staging: what a process of this node that
        is gone left (at once), and anything older than ``older_than`` seconds; returns
        how many items could not be removed (a read-only mount, ``EBUSY``)."""
        cutoff = time.time() - older_than
        try:
            with os.scandir(self.staging) as it:
                items = list(it)
        except OSError:
            return 1
        errors = 0
        for item in items:
            try:
                # Trash was renamed here under the space lock to be deleted: no one
                # uses it, whatever its age (a deletion that failed with EBUSY).
                doomed = item.name.startswith("trash.") or _left_here(item.name)
                if (doomed or item.stat(follow_symlinks=False).st_mtime < cutoff) and (
                    not remove_tree(item.path)
                ):
                    errors += 1
            except FileNotFoundError:
                continue  # another process swept it first
            except OSError:
                errors += 1
        return errors

    @property
    def folders(self) -> Mapping[str, int]:
        """The shard directories :meth:`entries_fd` opened so far (a live view)."""
        return self._folders

    def entries_fd(self, shard: str) -> int | None:
        """An open descriptor of the checked directory ``entries/<shard>``, or ``None``
        while it does not exist (reads miss; the first put makes it).

        Hits open their entry relative to it (``dir_fd``): the kernel then walks
        one path component, not the eight or so of the whole path (~0.8 us of a
        ~7 us hit), and the directory is the very one that was checked, even if
        a link were put in its place later. Kept until :meth:`close`.
        """
        fd = self._folders.get(shard)
        if fd is not None:
            return fd
        path = f"{self.entries}/{shard}"
        if not self.directory(path, create=False):
            return None
        try:
            fd = os.open(path, _OPEN_DIR)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not is_dir_error(exc):
                raise
            self.refused()  # replaced by a link or a file since it was checked
            raise UnsafeDirectory(f"{path} is not a directory (a link or a file)") from None
        problem = _fs.ownership_problem(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            self.refused()
            raise UnsafeDirectory(f"refusing {path}: {problem}")
        kept = self._folders.setdefault(shard, fd)
        if kept != fd:  # another thread opened it first
            os.close(fd)
        return kept

    def folder_fd(self, path: str) -> int:
        """An open descriptor of the directory ``path`` (checked before by :meth:`directory`
        or :meth:`shard_dir`), kept until :meth:`close`.

        The put path's lease files and counter are reached relative to it: on a network
        filesystem each folder of a path walked is a lookup, a round trip when names are
        not cached, about four per request without it (issue 40).
        """
        fd = self._open_dirs.get(path)
        if fd is not None:
            return fd
        try:
            fd = os.open(path, _OPEN_DIR)
        except OSError as exc:
            if not is_dir_error(exc):
                raise
            self.refused()  # replaced by a link or a file since it was checked
            raise UnsafeDirectory(f"{path} is not a directory (a link or a file)") from None
        problem = _fs.ownership_problem(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            self.refused()
            raise UnsafeDirectory(f"refusing {path}: {problem}")
        kept = self._open_dirs.setdefault(path, fd)
        if kept != fd:  # another thread opened it first
            os.close(fd)
        return kept

    def at(self, path: str) -> tuple[int | None, str]:
        """``path`` as its open folder and its name, for the ``dir_fd`` arguments of ``os``
        (:meth:`folder_fd`), when that folder is one the tree keeps (``v1``, staging, a
        shard; checked before), else ``(None, path)``: a key's folder may be renamed
        away, and requests relative to it would follow it."""
        folder, _, name = path.rpartition("/")
        if folder not in self._lasting:
            return None, path
        return self.folder_fd(folder), name

    def forget_moved(self, *paths: str, renamed: bool = False) -> bool:
        """Whether the open folder of any of ``paths`` (:meth:`at`) was removed since it was
        opened (by hand; the tier made again by another process): each such one is
        forgotten, and the folder at its name checked (made when missing), so that the
        next :meth:`at` names what the path names. A request that found nothing relative
        to an open folder asks this (an ``fstat`` per folder) before it believes it.

        ``renamed``: also a folder renamed away, not removed (the cache directory moved
        aside and made again), compared by name with the one at its path: a lookup
        each, for failures only (:meth:`DiskStore.put`)."""
        moved = False
        for path in paths:
            folder = path.rpartition("/")[0]
            fd = self._open_dirs.get(folder)
            if fd is None or _still_there(fd, folder, by_name=renamed):
                continue
            self.forget(folder)
            with contextlib.suppress(FileNotFoundError):  # the whole tree went: absent
                self.directory(folder, create=True)
            moved = True
        return moved

    def forget(self, folder: str) -> None:
        """Let the next :meth:`folder_fd` of ``folder`` open the folder its name holds then
        (the one open now was moved or removed since)."""
        fd = self._open_dirs.pop(folder, None)
        if fd is not None:
            # Not closed now: another thread may be naming a file relative to it.
            self._gone[f"{folder}#{fd}"] = fd

    def close(self) -> None:
        """Close the directories :meth:`entries_fd` and :meth:`folder_fd` opened (they are
        opened again if needed)."""
        self._folders.close()
        self._open_dirs.close()
        self._gone.close()

    # Checks --------------------------------------------------------------
    def check_root(self, create: bool) -> bool:
        """Raise :class:`UnsafeDirectory` unless the cache directory is safe to use.

        Creates it (0700) when ``create``; ``False`` when it does not exist.
        The path may be a symlink the user chose: its target is checked, and
        so are every ancestor and link on the way (:mod:`kernelcache._trust`).
        """
        try:
            created = create and not os.path.lexists(self.root)
            fd = _trust.open_dir(self.root, create=create)
        except _trust.UntrustedDirectory as exc:
            self.refused()
            fix = "`chmod go-w` what others can write (as its owner) or use another KERNELCACHE_DIR"
            raise UnsafeDirectory(f"refusing cache directory {exc}; {fix}") from None
        if fd is None:
            return False
        try:
            if created:  # a new cache directory says what it is (backup tools skip it)
                _write_tag(fd)
        finally:
            os.close(fd)
        return True

    def ensure(self, create: bool) -> None:
        """Check (and with ``create``, make) the top directories of ``v1``.

        A writable tier also removes what 0.1, before whole-tier
        accounting left: ``v1/files`` (extracted copies, now ``v1/extracted``)
        and ``v1/shards`` (per-shard counters, now ``v1/space``).
        """
        for folder in (self.base, self.entries, self.extracted, self.staging, self.lru, self.locks):
            self.directory(folder, create)
        if create:
            for old in (f"{self.base}/files", f"{self.base}/shards"):
                if os.path.lexists(old):
                    trash = self.trash()
                    with contextlib.suppress(FileNotFoundError):  # another process took it
                        os.rename(old, trash)
                        remove_tree(trash)

    def shard_dir(self, top: str, shard: str, create: bool) -> str:
        """``<top>/<shard>``, checked (made when ``create``) on its first use in this process."""
        path = f"{top}/{shard}"
        if path not in self._checked or self._pid != os.getpid():
            self.directory(path, create)
        return path

    def directory(self, path: str, create: bool) -> bool:
        """Whether ``path`` is a safe directory (``False``: missing and not created).

        A symlink or a file where a directory belongs is refused and counted;
        a writable tier removes it (it is inside the tier's own tree, so it
        is junk) and makes the directory. A directory owned by someone else,
        or writable by others, raises :class:`UnsafeDirectory`.
        """
        if self._pid != os.getpid():
            self._checked, self._pid = set(), os.getpid()
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return False
            with contextlib.suppress(FileExistsError):  # made by another process: checked below
                os.mkdir(path, 0o700)
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            self.refused()
            if not create:
                raise UnsafeDirectory(f"{path} is not a directory (a link or a file)")
            remove_tree(path)
            os.mkdir(path, 0o700)
            st = os.lstat(path)
        problem = _fs.ownership_problem(st)
        if problem is not None:
            self.refused()
            raise UnsafeDirectory(f"refusing {path}: {problem}")
        self._checked.add(path)
        return True

    def sub_folder(self, path: str, create: bool) -> bool:
        """Like :meth:`directory` for a folder below a shard (a key's or a tag's): not remembered."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return False
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and _fs.ownership_problem(st) is None:
            return True
        self.refused()
        if not create:
            return False
        remove_tree(path)
        os.mkdir(path, 0o700)
        return True


def _still_there(fd: int, folder: str, by_name: bool = False) -> bool:
    """Whether the open folder ``fd`` is still the folder at ``folder``: its link count
    says so without a lookup (a filesystem that reports none for a live folder is asked
    by name, so that no folder is forgotten, and opened again, at every miss), unless
    ``by_name`` (a folder renamed away keeps its links: only its name tells)."""
    try:
        held = os.fstat(fd)
    except OSError:  # ESTALE: removed on a network filesystem's server
        return False
    if held.st_nlink and not by_name:
        return True
    try:
        now = os.lstat(folder)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _write_tag(dir_fd: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open("CACHEDIR.TAG", flags, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(_CACHEDIR_TAG)


class _Folders(dict[str, int]):
    """Open directory descriptors by shard, closed with the store or when it is collected."""

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close bound now: __del__ may run at interpreter exit, after os is gone.
        while self:
            _shard, fd = self.popitem()
            _close(fd)

    def __del__(self) -> None:
        self.close()


def is_dir_error(exc: OSError) -> bool:
    """Whether ``exc`` says a path component is not a usable directory (a file, a link)."""
    return exc.errno in (errno.ENOTDIR, errno.ELOOP)


class Found:
    """One entry of a shard as a scan saw it, with its extracted bytes: a file (``st``), or
    a packed record (``st`` is ``None``; ``record`` is its offset, ``length`` and ``clock_ns``
    its size and last use; see :mod:`.pack`). ``shadow``: the bytes of an entry file of a
    packed key (a writer killed between packing a new version and removing the file): the
    packed record is the entry (it is what a get serves), and the file goes with it."""

    __slots__ = ("clock_ns", "extracted", "key", "length", "record", "shadow", "st")

    def __init__(
        self,
        key: str,
        st: os.stat_result | None,
        extracted: int = 0,
        *,
        record: int = -1,
        length: int = 0,
        clock_ns: int = 0,
    ) -> None:
        self.key = key
        self.st = st
        self.extracted = extracted
        self.record = record
        self.shadow = 0
        self.length = st.st_size if st is not None else length
        self.clock_ns = st.st_mtime_ns if st is not None else clock_ns

    @property
    def ino(self) -> int:
        """The file's inode; 0 for a packed record (the LRU queue's mark for one)."""
        return self.st.st_ino if self.st is not None else 0

    @property
    def size(self) -> int:
        """What the entry costs the tier: its file (or record) plus its extracted copies."""
        return self.length + self.extracted + self.shadow


def list_dir(layout: Layout, path: str) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of the items of directory ``path``, never through a link (a link
    there is refused and lists as empty: scanning it would count, and evict, what lies
    elsewhere). Items removed meanwhile are left out."""
    folder, name = layout.at(path)  # one lookup on a network filesystem, not one per folder
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder
        )
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        layout.refused()
        return []
    listed = []
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                listed.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
    finally:
        os.close(fd)
    return listed


def scan_shard(
    layout: Layout, shard: str, packed: Iterable[Found] = ()
) -> tuple[list[Found], list[str]]:
    """The entries of ``shard`` (its files, then its ``packed`` records) and the
    extraction folders of keys it no longer holds.

    Foreign items (other names, keys of another shard, links) are neither
    listed nor counted. Orphan folders are left by a process killed between
    removing an entry and its folder, or by a version that lost a race.
    """
    found: dict[str, Found] = {f.key: f for f in packed}
    for name, st in list_dir(layout, f"{layout.entries}/{shard}"):
        key = entry_key(name, st, shard)
        if key is None:
            continue
        if key in found:
            found[key].shadow = st.st_size  # the packed version is the entry (see Found)
        else:
            found[key] = Found(key, st)
    orphans = []
    top = f"{layout.extracted}/{shard}"
    items = list_dir(layout, top)
    folders = [(name, f"{top}/{name}") for name, st in items if stat.S_ISDIR(st.st_mode)]
    for key, path in folders:
        if not is_valid_key(key) or shard_of(key) != shard:
            continue  # foreign
        if key in found:
            found[key].extracted = tree_size(path)
        else:
            orphans.append(path)
    return list(found.values()), orphans
