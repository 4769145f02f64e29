"""The lock of a disk tier's space counter (``v1/space``): ``flock``, or a lease where that fails.

On a local filesystem it is an ``flock`` on the counter file itself, which
the kernel drops when its holder dies. On a network filesystem (``network``,
from :mod:`kernelcache.fstype`), or once ``flock`` fails with ``ENOLCK`` and
the like (Lustre without ``-o flock``), it is a lease file beside it
(:mod:`kernelcache.stores.lease`): ``flock`` may not conflict across
clients there, and a counter guarded by a lock that does not exclude loses
updates. Under a lease the counter is opened afresh each time and closed
before the lease goes, so each holder reads what the last one wrote
(close-to-open consistency, the one guarantee every NFS client gives).

Bounded waits: a change waits at most :data:`LEASE_WAIT` for another
process's lease, then gives up with :class:`TimeoutError` (the caller keeps
the value it compiled, not stored; issue 40: at 2 ms per request, eight
processes queueing for one lease stalled a caller 15 s). ``flock`` waits are
not bounded: a local holder takes microseconds per change.

Fail soft: whatever error comes after the lock is taken (``ESTALE``,
``EIO``), the lock is released before the error propagates; a leaked
``flock`` would block every other process's puts for good (issue 22).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from typing import TYPE_CHECKING

from kernelcache.errors import StoreError
from kernelcache.stores.lease import NO_FLOCK, LeaseLock

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kernelcache.stores.disk.layout import Layout

_OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
#: Seconds a change waits for another process's space lease (see the module docstring).
LEASE_WAIT = 3.0


class TierLock:
    """Exclusive access to one tier's counter file, for threads, processes and nodes.

    flock belongs to the open file description: threads sharing the
    descriptor are not excluded by it (hence the thread lock), and a forked
    child shares it with its parent (hence a new one after fork).
    """

    def __init__(self, layout: Layout, *, network: bool = False) -> None:
        self.layout = layout
        self._network = network
        self._lease: LeaseLock | None = None
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def network(self) -> bool:
        """Whether a lease is used (a network filesystem, or one without flock)."""
        return self._network or self._lease is not None

    @contextlib.contextmanager
    def held(self) -> Iterator[int]:
        """Hold the lock; yields the counter file's descriptor (open for reading and writing)."""
        if self._pid != os.getpid():
            self._fd, self._id, self._pid = None, None, os.getpid()
            self._lock, self._lease = threading.Lock(), None
        with self._lock:
            fd = self._take_lease() if self.network else self._take_flock()
            try:
                yield fd
            finally:
                self._unlock(fd)

    def _unlock(self, fd: int) -> None:
        if not self.network:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                self._drop_fd()  # closing the descriptor releases the lock all the same
                raise
            return
        assert self._lease is not None
        try:
            os.close(fd)  # flushes the counter to the server before the next holder opens it
        finally:
            self._lease.release()

    def _take_lease(self) -> int:
        """Take the lease file, then open the counter afresh (see the module docstring)."""
        if self._lease is None:
            base = self.layout.folder_fd(self.layout.base)
            self._lease = LeaseLock(self.layout.space + ".lease", dir_fd=base)
        try:
            if not self._lease.acquire(LEASE_WAIT):
                raise TimeoutError(
                    errno.ETIMEDOUT, f"the space lease stayed held for {LEASE_WAIT:g} s"
                )
        except StoreError as exc:
            # The tier's callers translate OS errors (and clean up after them).
            raise (
                exc.__cause__ if isinstance(exc.__cause__, OSError) else OSError(str(exc))
            ) from exc
        try:
            return self._open()
        except BaseException:
            self._lease.release()
            raise

    def _take_flock(self) -> int:
        """Lock the counter file that the path names now (it may have been removed or replaced)."""
        while True:
            if self._fd is None:
                self._fd = self._open()
                st = os.fstat(self._fd)
                self._id = (st.st_dev, st.st_ino)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except OSError as exc:
                self._drop_fd()
                if exc.errno not in NO_FLOCK:
                    raise
                # No flock on this filesystem (Lustre without -o flock): a lease from now on.
                return self._take_lease()
            try:
                st = os.lstat(self.layout.space)
                if (st.st_dev, st.st_ino) == self._id:
                    return self._fd
            except FileNotFoundError:
                pass
            except OSError:
                self._drop_fd()  # ESTALE/EIO with the lock taken: never leave it held
                raise
            # Deleted or replaced since we opened it: our lock guards nothing. Start over,
            # in the v1 folder the path names now: the open one may have been moved away
            # (the cache directory moved aside and made again), and would give the same
            # counter forever.
            self._drop_fd()
            self.layout.forget(self.layout.base)

    def _drop_fd(self) -> None:
        """Close the counter's descriptor, which releases any flock on it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # EIO on close (NFS): it is closed anyway
                os.close(fd)

    def _open(self) -> int:
        # Relative to the open v1 folder: one lookup on a network filesystem (folder_fd).
        name, base = os.path.basename(self.layout.space), self.layout.folder_fd(self.layout.base)
        try:
            return os.open(name, _OPEN, 0o600, dir_fd=base)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
        # A symlink: following it would write outside the cache. Refused, removed, recreated.
        self.layout.refused()
        os.unlink(name, dir_fd=base)
        return os.open(name, _OPEN | os.O_EXCL, 0o600, dir_fd=base)

    def close(self) -> None:
        if self._pid == os.getpid():
            self._drop_fd()
        self._fd = None
