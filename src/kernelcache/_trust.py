"""The one trust rule: whether a directory may be read, written or executed from.

A directory is trusted when it and every ancestor belong to this user or
root and cannot be written by anyone else (issue 19): otherwise another user
who can write an ancestor can rename the directory away and put one of
theirs in its place between a check and its use, and have a compile return
their entries or a launcher run their program. Ancestors that others may
write are accepted when they are sticky (``/tmp``), where nobody can rename
or remove an entry they do not own, as ssh's ``StrictModes`` and sudo
accept them; the directory itself is never: others could plant files in it.

:func:`open_dir` walks the path from ``/`` one component at a time with
``openat`` and ``O_NOFOLLOW``, checking each directory it opens (``fstat``:
the very one it will use) and each symbolic link it follows (which must
belong to this user or root as well), and hands back a descriptor of the
checked directory: files are then opened relative to it without following
links (:func:`open_file`). Once the chain is trusted, a path through it names
the same directory for as long as only this user and root change it, which
is why code that keeps paths (the disk tier) may use them after the check.

``kernelcache/nvcc/client.c`` applies the same rule in C before the compiled
client talks to the server; a test runs both on the same trees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from kernelcache import _fs
from kernelcache.errors import KernelCacheError

#: Symbolic links one walk follows at most (Linux's own limit is 40).
MAX_LINKS = 40
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
_NOT_A_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)

__all__ = ["MAX_LINKS", "UntrustedDirectory", "open_dir", "open_file", "refusal"]


class UntrustedDirectory(KernelCacheError):
    """A directory (or an ancestor, or a link on the way) that someone else could change."""


def _owner_problem(st: os.stat_result, what: str) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return f"{what} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}) or root"
    return None


def _ancestor_problem(st: os.stat_result, path: str) -> str | None:
    problem = _owner_problem(st, f"its ancestor {path}")
    if problem is None and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(st.st_mode)
        problem = f"its ancestor {path} is writable by group or others (mode {mode:o}, not sticky)"
    return problem


def open_dir(path: str, *, allow_root: bool = True, create: bool = False) -> int | None:
    """A descriptor of directory ``path`` (``O_DIRECTORY``, close-on-exec) once it is trusted.

    ``None`` when a component is missing (the existing part of the chain is
    trusted, so whoever makes the rest makes it private), unless ``create``:
    then the missing directories are made, mode 0700. Raises
    :class:`UntrustedDirectory` saying why the directory is not trusted
    (``allow_root=False``: it must be this user's own, as a directory a
    program runs from must), and ``OSError`` when it cannot be walked.
    """
    # Not os.path.abspath: it folds ".." on paper, the kernel after following links.
    pending = os.path.join(os.getcwd(), path).split("/")
    fd, where, links = os.open("/", _DIR), "/", 0
    try:
        problem = _ancestor_problem(os.fstat(fd), where)
        while problem is None:
            while pending and pending[0] in ("", "."):
                pending.pop(0)
            if not pending:
                problem = _fs.ownership_problem(os.fstat(fd), allow_root=allow_root)
                if problem is None:
                    fd, kept = -1, fd
                    return kept
                problem = problem if where == os.path.normpath(path) else f"{where}: {problem}"
                break
            name = pending.pop(0)
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                with contextlib.suppress(FileExistsError):  # made by another process: checked
                    os.mkdir(name, 0o700, dir_fd=fd)
                pending.insert(0, name)
                continue
            except OSError as exc:
                if exc.errno not in _NOT_A_DIRECTORY:
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    if not any(part not in ("", ".") for part in pending):
                        problem = "it is not a directory"  # the directory asked for
                        break
                    raise NotADirectoryError(
                        errno.ENOTDIR, os.strerror(errno.ENOTDIR), f"{where}/{name}"
                    ) from None
                links += 1
                problem = _owner_problem(st, f"the link {os.path.join(where, name)}")
                if links > MAX_LINKS:
                    problem = f"more than {MAX_LINKS} links on the way"
                target = os.readlink(name, dir_fd=fd)
                pending[:0] = target.split("/")
                if target.startswith("/"):
                    fd, parent, where = -1, fd, "/"
                    os.close(parent)
                    fd = os.open("/", _DIR)
                continue
            # fd never names a closed descriptor, which the finally would close again:
            # an exception between the two (a signal's handler: SIGTERM's SystemExit,
            # Ctrl-C) became that close's EBADF, an OSError callers take for a miss (a
            # launcher server sent SIGTERM as it counted a hit served on until idle,
            # issue 40), and in a threaded process the number may be another's file.
            fd, parent = child, fd
            os.close(parent)
            where = os.path.normpath(os.path.join(where, name))
            if any(part not in ("", ".") for part in pending):  # the last one: checked above
                problem = _ancestor_problem(os.fstat(fd), where)
        raise UntrustedDirectory(f"{path}: {problem}")
    finally:
        if fd >= 0:
            os.close(fd)


def refusal(path: str, *, allow_root: bool = True) -> str | None:
    """Why ``path`` must not be used (see :func:`open_dir`), or ``None`` (trusted or missing)."""
    try:
        fd = open_dir(path, allow_root=allow_root)
    except UntrustedDirectory as exc:
        return f"refusing {exc}"
    except OSError as exc:
        return f"refusing {path}: {exc.strerror or exc}"
    if fd is not None:
        os.close(fd)
    return None


def open_file(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """Open ``name`` in the checked directory ``dir_fd``, never through a link (``O_NOFOLLOW``)."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
