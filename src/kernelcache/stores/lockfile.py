"""Per-key lock files for single-flight compiles across the processes of one machine.

A :class:`FileFlightLock` is an ``flock`` on ``<dir>/<key>.lock``. The kernel
drops an ``flock`` when its holder dies, so a SIGKILLed compile never leaves
the key locked: the next waiter gets the lock at once.

The holder unlinks the file before it unlocks, so lock files do not pile up.
That opens the classic unlink race: a waiter blocked on the old inode wakes
up holding a lock on a file nobody else can see any more, while a newcomer
creates and locks a fresh file under the same name. So after every acquire
the waiter checks that the path still names the inode it locked and starts
over if not; with that check, only one process at a time holds the lock that
the path names.

Waiting is a blocking ``flock`` in a helper thread, not polling: the kernel
wakes the waiter the moment the holder releases (tens of microseconds), and a
waiter costs no CPU during a long compile. A waiter that gives up leaves the
thread blocked; when it finally gets the lock it closes the file, releasing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable

from kernelcache.errors import StoreError
from kernelcache.stores.lease import NO_FLOCK, LeaseLock, take

#: A lease file's name beside its key's lock file (``<key>.lease``).
LEASE_SUFFIX = ".lease"
# Lock folders where flock failed with a NO_FLOCK error: leases from then on.
_no_flock: set[str] = set()

#: Lock files whose name is not current but were left by a killed holder are
#: swept by :func:`sweep_locks` once older than this.
STALE_LOCK_SECONDS = 3600.0

# Every lock file descriptor this process has open. A forked child inherits
# them, and an flock lives until the *last* descriptor of its open file is
# closed: a child (a DataLoader worker forked mid-compile) would keep the
# parent's lock held after the parent released it, and the waiters would hang
# until the child exits. So the child closes its copies right after fork
# (closes, never LOCK_UN, which would release the parent's lock too).
_open_fds: set[int] = set()
# Held across each open/close and around fork() itself, so a child never
# inherits a descriptor that is open but not yet (or no longer) registered.
_fds_lock = threading.Lock()


def open_lock_fd(path: str, opener: Callable[[str, int], int] | None = None) -> int:
    """Open (creating) a lock file; the descriptor is closed in forked children.

    Never through a symlink (``O_NOFOLLOW``: ``OSError`` with ``ELOOP``): a
    link planted at a lock file would make us create or lock files elsewhere.
    ``opener(path, flags)`` opens it instead of ``os.open`` (as ``open()``'s
    ``opener``): relative to a checked directory, say (:mod:`kernelcache._memos`).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    with _fds_lock:
        fd = os.open(path, flags, 0o600) if opener is None else opener(path, flags)
        _open_fds.add(fd)
    return fd


def close_lock_fd(fd: int) -> None:
    """Close a lock descriptor. An error from close (``EIO`` on NFS) is ignored: the
    descriptor is gone either way on Linux, and with it the lock."""
    with _fds_lock:
        _open_fds.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_inherited() -> None:
    for fd in _open_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_fds.clear()
    _fds_lock.release()


os.register_at_fork(
    before=_fds_lock.acquire, after_in_parent=_fds_lock.release, after_in_child=_close_inherited
)


class FileFlightLock:
    """An exclusive, crash-safe lock named by a path (see the module docstring).

    Not reentrant and not shared between threads: each single-flight leader
    makes its own. ``on_error`` is called once for each OS error before it is
    raised as :class:`StoreError`, so the owning tier can count it.
    """

    def __init__(
        self,
        path: str,
        on_error: Callable[[], None] | None = None,
        *,
        leases: bool = False,
        after_lease: Callable[[], None] | None = None,
        dir_fd: int | None = None,
    ) -> None:
        self.path = path
        # The lock's folder, open: a lease's requests name its file relative to it.
        self._dir_fd = dir_fd
        # Called once a lease is taken, before the caller looks for the entry (see DiskStore).
        self._after_lease = after_lease
        self._leases = leases  # a network filesystem: flock may not span its clients
        self._on_error = on_error
        self._fd: int | None = None
        self._lease: LeaseLock | None = None

    def __repr__(self) -> str:
        held = self._fd is not None or self._lease is not None
        return f"FileFlightLock({self.path!r}, held={held})"

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting at most ``timeout`` seconds; ``False`` if that ran out."""
        if self._fd is not None or self._lease is not None:
            raise RuntimeError(f"{self!r} is already held")
        folder = os.path.dirname(self.path)
        if self._leases or folder in _no_flock:
            return self._acquire_lease(timeout)
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            while True:
                fd = self._open()
                if not self._lock(fd, deadline):
                    return False  # _lock closed fd (or left it to the helper thread)
                try:
                    names = self._names(fd)
                except OSError:
                    close_lock_fd(fd)  # ESTALE/EIO after locking: never leak the lock
                    raise
                if names:
                    self._fd = fd
                    return True
                close_lock_fd(fd)  # we locked an unlinked file: the holder released it; retry
        except OSError as exc:
            if exc.errno in NO_FLOCK:
                # Lustre without -o flock and the like: a lease file serves instead,
                # for every later lock in this folder too.
                _no_flock.add(folder)
                with contextlib.suppress(OSError):  # nobody can flock it here: just clutter
                    os.unlink(self.path)
                return self._acquire_lease(deadline - time.monotonic())
            self._failed()
            raise StoreError(f"lock {self.path}: {exc}") from exc

    def _acquire_lease(self, timeout: float) -> bool:
        lease = LeaseLock(
            self.path[: -len(".lock")] + LEASE_SUFFIX, on_error=self._on_error, dir_fd=self._dir_fd
        )
        if not lease.acquire(timeout):
            return False
        self._lease = lease
        if self._after_lease is not None:
            self._after_lease()
        return True

    def _failed(self) -> None:
        if self._on_error is not None:
            self._on_error()

    def release(self) -> None:
        """Unlink the lock file, then unlock it (in that order: see the module docstring).

        Never raises an OS error: one (``EBUSY``, ``ESTALE``) is counted and the file
        is left to :func:`sweep_locks`; the lock itself is released all the same.
        """
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.release()
            return
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self!r} is not held")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # swept by sweep_locks
        except OSError:
            self._failed()
        finally:
            close_lock_fd(fd)

    def _open(self) -> int:
        try:
            return open_lock_fd(self.path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            return open_lock_fd(self.path)

    def _names(self, fd: int) -> bool:
        """Whether the path still names the file ``fd`` has open."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _lock(fd: int, deadline: float) -> bool:
        return lock_within(fd, deadline - time.monotonic())


def lock_within(fd: int, timeout: float) -> bool:
    """Take an exclusive ``flock`` on ``fd`` (from :func:`open_lock_fd`) within ``timeout`` seconds.

    ``False`` when the time ran out, or an ``OSError``: ``fd`` is then no longer
    the caller's (it is closed, at once or when a helper thread's wait ends).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass  # held by another process: wait for it below
    except OSError:
        close_lock_fd(fd)
        raise
    if timeout <= 0:
        close_lock_fd(fd)
        return False
    return _BlockingWait(fd).wait(timeout)


class _BlockingWait:
    """A blocking ``flock`` in a daemon thread, abandoned cleanly on timeout."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.done = threading.Event()
        self.abandoned = False
        self.error: OSError | None = None
        self._mutex = threading.Lock()

    def wait(self, timeout: float) -> bool:
        threading.Thread(target=self._run, name="kernelcache-flock", daemon=True).start()
        self.done.wait(timeout)
        with self._mutex:
            if not self.done.is_set():
                self.abandoned = True  # the thread closes fd once flock returns
                return False
        if self.error is not None:
            close_lock_fd(self.fd)
            raise self.error
        return True

    def _run(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            self.error = exc
        with self._mutex:
            if self.abandoned:
                close_lock_fd(self.fd)  # releases the lock we got too late
            else:
                self.done.set()


def sweep_locks(root: str, older_than: float = STALE_LOCK_SECONDS) -> int:
    """Remove lock files under ``root`` left by killed holders; returns how many.

    A file is removed only while this process holds its lock (so no live
    holder loses it) and after it has aged ``older_than`` seconds; a lease
    file (:mod:`.lease`) once its holder stopped renewing it that long ago.
    """
    removed = 0
    cutoff = time.time() - older_than
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if not name.endswith((".lock", LEASE_SUFFIX, ".taken")):
                continue
            path = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_mtime >= cutoff:
                    continue
                if not name.endswith(".lock"):
                    # A lease renewed by no one for that long, or a takeover's leftover.
                    removed += take(path, lambda _record: True)
                    continue
                lock = FileFlightLock(path)
                if lock.acquire(0.0):
                    lock.release()  # release() unlinks it
                    removed += 1
    return removed
