"""Lock files that hold where ``flock`` does not: one exclusive file with an owner and a lease.

Used by the disk tier on a network filesystem (:mod:`kernelcache.fstype`) and
wherever ``flock`` fails outright (Lustre mounted without ``-o flock`` gives
``ENOLCK``, others ``EINVAL``/``ENOSYS``/``EOPNOTSUPP``), for single-flight
and for the tier's space counter. Why this mechanism (issue 22):

- ``flock`` across NFS clients conflicts or not depending on the kernel
  version, mount options and lockd; on FUSE stores it never does. A lock
  that silently does not exclude is worse than none.
- POSIX ``fcntl`` locks go through lockd/NLM on NFSv3 and are dropped by
  *any* close of the file in the process: unusable inside a library.
- The team tier's Redis lease already joins single-flight when one is
  configured (:mod:`kernelcache.singleflight` takes every tier's lock), but
  the disk tier must be correct on its own, and its space counter lives in
  the directory.
- ``open(O_CREAT | O_EXCL)`` is atomic on the server for NFSv3 and v4,
  Lustre, GPFS, BeeGFS, CephFS, SMB and FUSE: one round trip per acquire.
  The ``link()`` trick (temp file, link, stat, unlink: five round trips) is
  only needed by NFSv2, which current kernels no longer enable.

The file holds its owner: host, boot id, pid, a random nonce and a beat
counter. The holder rewrites the beat every ``lease / 4`` seconds (a daemon
thread, ``fsync`` so that other clients see it). A waiter takes the lock
over when the owner is dead on this very machine (same host and boot id, no
such pid), or when the record has not changed for ``lease`` seconds on the
waiter's own monotonic clock: no clocks are compared across nodes.

That clock runs across this process's waits, not within one: most waits are
far shorter than a lease (the space lease's :data:`.tierlock.LEASE_WAIT` is
3 s, a cleaner's 0 s), and a clock restarted by each would never reach the
term. A lease file no one renews (an empty one, whose holder's write of its
record failed and whose removal failed too; a live process's that it no
longer holds) then stalled every later wait for good: every put of every
other process gave up as busy (issue 40's random-EIO stress: at 4 % EIO, about 1
run in 10 hung; none in 200 since).

Takeover and release never unlink a name blindly: the file is first renamed
to a private name (atomic on the server), read, and removed only if it is
the record that was judged dead (or our own); a live one taken by mistake is
linked back. So a slow holder whose lease expired loses it, and learns so
(:attr:`LeaseLock.lost`), but never removes its successor's lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable

from kernelcache._fs import boot_id, exists_afresh, pid_alive, unique
from kernelcache.errors import StoreError

#: A holder that stops renewing for this long is taken over (seconds).
LEASE_SECONDS = 30.0
#: ``flock`` errors that mean "no flock on this filesystem": use a lease file instead.
NO_FLOCK = frozenset({errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_RECORD_MAX = 512
#: What a holder whose release failed writes into its lease: waiters take it at once.
_FREE = b"free\n"
# Nonces of the leases this process holds now.
_held: set[str] = set()
_TRANSIENT = frozenset({errno.ESTALE, errno.EIO, errno.EBUSY, errno.EINTR})
_FIRST_POLL = 0.002
_LAST_POLL = 0.1
#: How long a release looks for its lease's name while it is away (another's take()).
_AWAY = 0.5
#: What a wait compares between its looks at a lease file (:func:`_read_seen`).
Seen = tuple[bytes, int, int]
#: Lease files watched by this process's waits: path -> (what was seen, since when).
_watched: dict[str, tuple[Seen, float]] = {}
_WATCHED_MAX = 1024
_watched_lock = threading.Lock()
_STRIPE_COUNT = 64


def _new_stripes() -> tuple[threading.Lock, ...]:
    return tuple(threading.Lock() for _ in range(_STRIPE_COUNT))


# A take() has the lease it judges away from its name for a moment (renamed, read, linked
# back), and a create in that moment finds the name free: two holders. Between threads of
# this process, a take and a create of one name never overlap (a stripe of the name each).
# Between processes the moment stays; it needs a take of a lease that another waiter
# replaced since it was read, and a third waiter's create just then.
_stripes = _new_stripes()


def _stripe(path: str) -> threading.Lock:
    return _stripes[hash(path) % _STRIPE_COUNT]


def _fresh_stripes_in_child() -> None:
    global _stripes, _watched_lock
    _stripes = _new_stripes()  # a forked child lacks the thread that may hold one
    _watched_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_stripes_in_child)


_HOST = os.uname().nodename
_BOOT = boot_id()


def read_record(path: str, dir_fd: int | None = None) -> bytes | None:
    """The lock file's record (a fresh open: close-to-open consistency), ``None`` if absent.

    ``dir_fd``: ``path`` is a name in that open directory (:class:`LeaseLock`)."""
    try:
        fd = os.open(path, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, _RECORD_MAX)
    finally:
        os.close(fd)


def _seen_since(path: str, seen: Seen | None, now: float) -> float:
    """Since when (monotonic) this process has seen ``seen`` under the lease ``path``,
    across its waits (see the module docstring): ``now`` when it is new. ``None``: no
    file there (forgotten)."""
    with _watched_lock:
        if seen is None:
            _watched.pop(path, None)
            return now
        known = _watched.get(path)
        if known is not None and known[0] == seen:
            return known[1]
        if len(_watched) >= _WATCHED_MAX:
            del _watched[next(iter(_watched))]  # the oldest: a wait starts its clock afresh
        _watched[path] = (seen, now)
        return now


def _read_seen(name: str, dir_fd: int | None) -> tuple[bytes | None, Seen | None]:
    """The lock file's record, and what a waiter compares between looks: the record, with
    the file's inode and modification time when it is empty. Every empty record reads
    alike, and one seen now and one seen a lease later may be two holders', each between
    its create and its write, even with one inode number (freed and reused); the server
    stamps each create (compared only with itself: no clocks across nodes)."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    try:
        record = os.read(fd, _RECORD_MAX)
        if record:
            return record, (record, 0, 0)
        st = os.fstat(fd)
        return record, (record, st.st_ino, st.st_mtime_ns)
    finally:
        os.close(fd)


def dead_here(record: bytes) -> bool:
    """Whether ``record`` names no live holder: a process of this machine (this boot) that is
    gone, a lease of this very process that it no longer holds (its release failed), or a
    lease its holder marked free (its first bytes: the rest of its record may follow)."""
    if record.startswith(_FREE):
        return True
    fields = record.split(b" ")
    if len(fields) < 5 or fields[0].decode(errors="replace") != _HOST:
        return False
    if fields[1].decode(errors="replace") != _BOOT:
        return True  # this host, an earlier boot: every process of it is gone
    try:
        pid = int(fields[2])
    except ValueError:
        return False
    if pid == os.getpid():
        return fields[3].decode(errors="replace") not in _held
    return not pid_alive(pid)


class LeaseLock:
    """An exclusive lock named by ``path`` that needs no ``flock`` (see the module docstring).

    Implements :class:`kernelcache.stores.base.FlightLock`. Not shared between
    threads. ``on_error`` is called for each OS error before it is raised as
    :class:`StoreError`.
    """

    def __init__(
        self,
        path: str,
        lease: float = LEASE_SECONDS,
        on_error: Callable[[], None] | None = None,
        *,
        dir_fd: int | None = None,
    ) -> None:
        self.path = path
        # With the folder open (``dir_fd``), each request names the file alone: on a
        # network filesystem every folder of a path walked is a lookup, a round trip
        # each when names are not cached (issue 40: ~5 per request, ~20 per lease).
        # A descriptor of its own (a local dup, no request): the renewing thread and
        # the release use it whenever they run, and the caller's may be closed by
        # then (a store closed meanwhile), its number reused by an unrelated file.
        self._dir_fd = None if dir_fd is None else os.dup(dir_fd)
        if self._dir_fd is not None:
            # Not at exit: a daemon renewer may still run then, and the process's end
            # closes it anyway.
            weakref.finalize(self, os.close, self._dir_fd).atexit = False
        self._name = path if dir_fd is None else os.path.basename(path)
        self.lease = lease
        self._on_error = on_error
        self._nonce = ""
        self._stop: threading.Event | None = None
        self._renewer: threading.Thread | None = None
        #: Set when the lease was taken over while held (the holder was too slow).
        self.lost = False

    def __repr__(self) -> str:
        return f"LeaseLock({self.path!r}, held={self.held})"

    @property
    def held(self) -> bool:
        """Whether this lock is held (acquired, its release not begun)."""
        return self._stop is not None

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting at most ``timeout`` seconds; ``False`` if that ran out."""
        if self._stop is not None:
            raise RuntimeError(f"{self!r} is already held")
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            return self._acquire(deadline)
        except OSError as exc:
            if self._on_error is not None:
                self._on_error()
            raise StoreError(f"lease {self.path}: {exc}") from exc

    def _acquire(self, deadline: float) -> bool:
        poll = _FIRST_POLL
        failures = 0
        while True:
            try:
                if self._try_create():
                    _seen_since(self.path, None, 0.0)
                    return True
                record, seen = _read_seen(self._name, self._dir_fd)
            except OSError as exc:
                # ESTALE/EIO from a server that answers the next request: retried
                # (after a pause), as a lock that is not ours yet; a third one in a row raises.
                failures += 1
                if exc.errno not in _TRANSIENT or failures >= 3:
                    raise
                time.sleep(poll)
                continue
            failures = 0
            now = time.monotonic()
            # Renewed, or a new holder: its lease restarts. Unchanged: counted since this
            # process first saw it so, in this wait or an earlier one.
            seen_at = _seen_since(self.path, seen, now)
            if record is not None and (dead_here(record) or now - seen_at >= self.lease):
                self._take(record)
                continue
            if now >= deadline:
                return False
            time.sleep(min(poll, max(0.0, deadline - now)))
            poll = min(poll * 2, _LAST_POLL)

    def _try_create(self) -> bool:
        try:
            return self._create()
        except FileExistsError:
            return False

    def _create(self) -> bool:
        nonce = unique()
        # Held before the record exists: another thread of this process must never
        # judge it a lease this process left behind (see dead_here).
        _held.add(nonce)
        try:
            with _stripe(self.path):  # never while a take() of this process has it away
                fd = os.open(self._name, _CREATE, 0o600, dir_fd=self._dir_fd)
        except FileNotFoundError:
            _held.discard(nonce)
            if self._dir_fd is not None:
                raise  # the open folder itself was removed: nothing to make it in
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            return self._create()
        except BaseException:  # FileExistsError (held by another) included
            _held.discard(nonce)
            raise
        try:
            try:
                os.write(fd, self._record(nonce, 0))
            finally:
                os.close(fd)  # close flushes it to the server: others read it on open
        except BaseException:
            _held.discard(nonce)
            self._unlink_unwritten()
            raise
        self._nonce, self.lost = nonce, False
        stop = self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew, args=(stop, nonce), name="kernelcache-lease", daemon=True
        )
        self._renewer.start()
        return True

    def _unlink_unwritten(self) -> None:
        """Remove the lease file just made (``O_EXCL``: ours) whose record was not written.

        Left there, empty, it names no holder, and waiters take it over only after
        a whole lease (30 s): a transient error is retried. No one else removes or
        replaces an empty file sooner, so the name is still ours."""
        for _attempt in range(3):
            try:
                os.unlink(self._name, dir_fd=self._dir_fd)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    return

    @staticmethod
    def _record(nonce: str, beat: int) -> bytes:
        return f"{_HOST} {_BOOT} {os.getpid()} {nonce} {beat}\n".encode()

    def _renew(self, stop: threading.Event, nonce: str) -> None:
        beat = 0
        while not stop.wait(self.lease / 4):
            beat += 1
            try:
                fd = os.open(
                    self._name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dir_fd
                )
            except OSError:
                # ESTALE/EIO, or no name: another process's take() may have the lease away
                # for a moment (it links ours back). The next beat tries again, well
                # within the lease; a successor's lease there ends the renewing.
                continue
            try:
                # Checked through the very descriptor written to: a successor's
                # file that replaced ours is never overwritten.
                if not _owned(os.pread(fd, _RECORD_MAX, 0), nonce):
                    self.lost = True  # taken over: someone judged us dead
                    return
                os.pwrite(fd, self._record(nonce, beat), 0)
                os.fsync(fd)
            except OSError:
                continue  # a transient error: the next beat tries again
            finally:
                os.close(fd)

    def _take(self, expected: bytes | None) -> bool:
        """Remove the lock file if it still holds ``expected``; ``True`` if it did."""
        return take(self.path, lambda record: record == expected, dir_fd=self._dir_fd)

    def release(self) -> None:
        """Stop renewing and remove the lock file if it is still ours.

        OS errors are counted and swallowed: an unremoved lease expires.
        """
        stop, self._stop = self._stop, None
        if stop is None:
            raise RuntimeError(f"{self!r} is not held")
        stop.set()
        if self._renewer is not None:
            self._renewer.join(self.lease)  # no beat may land between our check and removal
            self._renewer = None
        nonce = self._nonce
        try:
            if not self._remove(nonce):
                self._mark_free(nonce)
        finally:
            # Only now: until its file is gone, no thread of ours may judge it left behind.
            _held.discard(nonce)

    def _remove(self, nonce: str) -> bool:
        """Remove our lease file: ``True`` once none of ours is left under the name (removed,
        or taken over), ``False`` if errors kept it there."""
        pause, failures, away = _FIRST_POLL, 0, 0.0
        while True:  # a lease left behind stalls every waiter for its whole term
            try:
                if take(self.path, lambda r: _owned(r, nonce), dir_fd=self._dir_fd):
                    return True
                # Another's lease (ours was taken over: put back), or no name: taken over
                # and freed since, or away for a moment. Another process's take() renames
                # a lease to read it, then links it back: ours would come back with no holder.
                record = read_record(self._name, self._dir_fd)
                if not (record is None or _owned(record, nonce)) or away >= _AWAY:
                    self.lost = True
                    return True
                away += pause
            except OSError:
                if self._on_error is not None:
                    self._on_error()
                failures += 1
                if failures >= 3:
                    return False
            time.sleep(pause)  # EBUSY while another client has it open for a moment
            pause = min(pause * 2, _LAST_POLL)

    def _mark_free(self, nonce: str) -> None:
        """Say in the file itself that the lease is free (writing needs no rename)."""
        try:
            fd = os.open(self._name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dir_fd)
        except OSError:
            return  # the lease then expires
        try:
            if _owned(os.pread(fd, _RECORD_MAX, 0), nonce):
                # Marked before it is cut: a failed write leaves our record (it expires),
                # never an empty file, and a failed cut leaves "free" first (dead_here).
                os.pwrite(fd, _FREE, 0)
                os.ftruncate(fd, len(_FREE))
        except OSError:
            return
        finally:
            os.close(fd)


def _read_fresh(path: str, dir_fd: int | None) -> bytes | None:
    """``read_record`` of the file the server holds under ``path``, not of the one this
    node cached under the name (:func:`kernelcache._fs.exists_afresh`)."""
    return read_record(path, dir_fd) if exists_afresh(path, dir_fd) else None


def _owned(record: bytes | None, nonce: str) -> bool:
    return record is not None and record.split(b" ")[3:4] == [nonce.encode()]


def take(path: str, accept: Callable[[bytes | None], bool], dir_fd: int | None = None) -> bool:
    """Remove the lock file ``path`` if ``accept`` its record; ``True`` if it did.

    Renamed to a private name first (atomic on the server), so the record
    judged is the file removed; one not accepted, or not readable (the OS
    error is raised), is linked back, unless a newer one holds the name already
    (another process's create in that moment; never another thread's: ``_stripe``).
    ``dir_fd``: ``path``'s folder, open; the requests name the file relative to it.
    """
    with _stripe(path):
        if dir_fd is not None:
            path = os.path.basename(path)
        return _take_unstriped(path, accept, dir_fd)


def _take_unstriped(path: str, accept: Callable[[bytes | None], bool], dir_fd: int | None) -> bool:
    private = f"{path}.{unique()}.taken"
    try:
        os.rename(path, private, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    try:
        try:
            record = _read_fresh(private, dir_fd)
        except OSError:
            # ESTALE, EIO: unjudged, so maybe a live lease taken since it was judged dead.
            # If the link fails too, the name is free and its holder learns it is lost.
            with contextlib.suppress(OSError):
                os.link(private, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            raise
        if record is None:
            return False  # gone from its private name as well: nothing to judge or put back
        if accept(record):
            return True
        with contextlib.suppress(FileExistsError):
            os.link(private, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private, dir_fd=dir_fd)
