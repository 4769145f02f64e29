"""File-system mechanisms, one home each: unique names, writing files whole,
publishing them atomically, and deciding when a file's stat vouches for its content.

Everything that writes a file others may read (entries, statistics, memos,
the launcher's outputs) goes through :func:`write_new` and
:func:`write_atomic`; everything that trusts a stat instead of re-reading a
file (toolchain probes, NVRTC headers, the launcher's manifests) compares
:func:`signature` values and asks :func:`too_new` first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from typing import TYPE_CHECKING

from kernelcache.fstype import network_device

if TYPE_CHECKING:
    from collections.abc import Sequence

#: A stat whose mtime or ctime is this recent does not vouch for the content:
#: a write within the file system's timestamp granularity may leave both
#: unchanged (ccache's "file too new" rule; 2 s covers the coarsest common
#: granularity, FAT's). Such files are re-read rather than trusted.
TOO_NEW_NS = 2_000_000_000

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
#: Files :func:`holds` remembers per table before it starts over.
PINS_MAX = 4096
#: Buffers one ``writev`` takes at most (IOV_MAX on Linux and macOS).
_IOV_MAX = 1024


def unique() -> str:
    """A random name part (``uuid`` would cost its import, and ``platform``'s, per launch)."""
    return os.urandom(16).hex()


_O_PATH = getattr(os, "O_PATH", None)  # Linux
_DELETED = " (deleted)"


def exists_afresh(path: str, dir_fd: int | None = None) -> bool:
    """Whether the server holds ``path``, with the name looked up afresh on this node.

    A client may answer from names it cached (NFS ``lookupcache``, FUSE), and a rename
    carries a cached name along: renamed away by its name, the file may be another
    node's newer one, yet the new name shows the one cached. An exclusive create is
    never answered from that cache: once it fails with ``EEXIST``, the name is current
    here (one round trip). When nothing was there, the file it made is removed again.
    ``dir_fd``: ``path`` is a name in that open directory.
    """
    try:
        fd = os.open(path, _CREATE, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        return True
    os.close(fd)  # nothing was there: ours, made just now
    os.unlink(path, dir_fd=dir_fd)
    return False


def realpath(path: str) -> str:
    """``os.path.realpath(path)``, resolved by the kernel where it can.

    ``os.path.realpath`` walks the path in Python, an ``lstat`` per component:
    ~0.1 ms for a toolkit's ``bin/nvcc``, paid several times per key (issue 23).
    On Linux an ``O_PATH`` open resolves it in one call and ``/proc/self/fd``
    names the result. A path that does not open so (missing, a loop, not a
    directory where one is needed, no ``/proc``) goes to ``os.path.realpath``,
    whose answer for those cases is the contract.
    """
    if _O_PATH is None:
        return os.path.realpath(path)
    try:
        fd = os.open(path, _O_PATH | os.O_CLOEXEC)
    except (OSError, ValueError):  # ValueError: an embedded NUL, which realpath reports
        return os.path.realpath(path)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)
    # Unlinked since the open: the kernel's name is no path any more.
    if not real.startswith("/") or real.endswith(_DELETED):
        return os.path.realpath(path)
    return real


def signature(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What identifies a file's content without reading it: device, inode, size, mtime, ctime.

    Any write changes mtime and ctime (unless within the timestamp
    granularity: see :func:`too_new`); a rename over the path changes the inode.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def too_new(st: os.stat_result, now_ns: int, *, network: bool = True) -> bool:
    """Whether ``st`` changed too recently (relative to ``now_ns``, ``time.time_ns()``) to
    vouch for the file's content.

    With ``network`` (the default), a stat from a network filesystem never
    vouches: another node's write may not show in it for as long as the client
    caches attributes (NFS ``actimeo``, 3-60 s), so the content is read again
    (issue 22). Only the toolchain's memo opts out (toolkits on NFS are common,
    re-probing them per process costs a compile's worth, and they do not change
    under running jobs).
    """
    if now_ns - max(st.st_mtime_ns, st.st_ctime_ns) < TOO_NEW_NS:
        return True
    return network and network_device(st.st_dev)


def write_new(
    path: str,
    parts: Sequence[bytes | memoryview],
    *,
    mode: int = 0o600,
    durable: bool = False,
    dir_fd: int | None = None,
) -> None:
    """Create ``path`` (it must not exist; a symlink there is refused) holding ``parts``.

    For files in a private staging area, published afterwards by a rename.
    ``durable`` adds an ``fsync`` before returning; ``dir_fd``: ``path`` is
    relative to that directory (a checked one, see :mod:`kernelcache._trust`).

    The parts go out in one ``writev``, not one ``write`` each: a file
    written in one call gets large page-cache folios (ext4, XFS), which the
    kernel copies to a reader in far fewer steps. A 1 MiB entry written as
    header, then data read ~12 us (25 %) slower on every hit than one
    written whole (measured with benchmarks/bench_stores.py).
    """
    fd = os.open(path, _CREATE, mode, dir_fd=dir_fd)
    try:
        _write_all(fd, parts)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    pending = [part for part in parts if len(part)]
    while pending:
        batch = pending[:_IOV_MAX]
        written = os.writev(fd, batch)
        # A short write (a signal, a full disk that frees up) leaves the rest pending.
        for index, part in enumerate(batch):
            if written < len(part):
                pending[: index + 1] = [memoryview(part)[written:]]
                break
            written -= len(part)
        else:
            del pending[: len(batch)]


def write_atomic(
    path: str,
    data: bytes | Sequence[bytes | memoryview],
    *,
    staging: str | None = None,
    mode: int = 0o600,
    durable: bool = False,
    unlink_first: bool = False,
    dir_fd: int | None = None,
) -> None:
    """Replace ``path`` with ``data`` so that no reader ever sees it partly written.

    The bytes go to a new file in ``staging`` (default: beside ``path``; it
    must be on the same file system), which is then renamed over ``path``.
    ``unlink_first`` removes the old file before the rename: on ext4,
    renaming over an existing file forces a flush of the new data
    (``auto_da_alloc``), ~2 ms per file, which the launcher's outputs need
    not pay; readers then see no file for a moment instead of the old one.
    ``dir_fd``: both names are relative to that directory. Raises
    ``OSError``; nothing is left behind on failure.
    """
    folder = staging if staging is not None else os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)[:64]}.{unique()}.tmp")
    parts = [data] if isinstance(data, bytes) else data
    try:
        write_new(tmp, parts, mode=mode, durable=durable, dir_fd=dir_fd)
        if unlink_first:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path, dir_fd=dir_fd)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def holds(path: str, data: bytes, pins: dict[str, tuple[int, int, int, int, int]]) -> bool:
    """Whether ``path`` is a regular file (not a symlink) holding exactly ``data``.

    For files handed to loaders: the content is compared once, then the
    file is remembered in ``pins`` by its :func:`signature` and trusted while
    the signature holds (any write or replacement changes it), unless it is
    :func:`too_new` to vouch for its content.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
        return False
    if pins.get(path) == signature(st):
        return True
    try:
        fd = os.open(path, _READ)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            return False
        raise
    try:
        st = os.fstat(fd)
        same = st.st_size == len(data) and _read_all(fd, st.st_size) == data
    finally:
        os.close(fd)
    if same and not too_new(st, time.time_ns()):
        if len(pins) >= PINS_MAX:
            pins.clear()
        pins[path] = signature(st)
    return same


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def ownership_problem(st: os.stat_result, *, allow_root: bool = True) -> str | None:
    """Why a directory with status ``st`` (from ``lstat``) must not be trusted, or ``None``.

    Owned by this user (or root, with ``allow_root``), not writable by group or
    others (ssh's rule): anyone else who can write there can plant entries that
    a compile returns, or a program that a launcher runs.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    owners = (os.geteuid(), 0) if allow_root else (os.geteuid(),)
    if st.st_uid not in owners:
        return f"it belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def boot_id() -> str:
    """This boot of this machine (with the host name, what tells a pid's process apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "-"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace runs; another user's counts as alive,
    and so does anything that cannot be told (a lock or staging file is then kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: someone else's process
    return True
