"""Memo files under the cache directory (probe results, header-tree digests).

A memo feeds key fields: a forged one changes what goes into every key. So
it follows the rule the cache entries follow (issue 19, item 8): it is read
only from a directory that :func:`kernelcache._fs.ownership_problem` accepts,
only when the file itself is a regular file of this user that nobody else may
write, opened without following links; and with ``KERNELCACHE_READONLY`` set
nothing is written, not even the directory. A memo that cannot be trusted or
written costs a re-hash, never an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from kernelcache import _fs
from kernelcache.stores import lockfile

_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
#: A memo larger than this is not a memo kernelcache wrote: ignored.
MAX_BYTES = 16 << 20
# Values of KERNELCACHE_READONLY that mean "writable" (Settings reads the same
# variable; anything else, even a typo, writes no memo: read-only is the safe side).
_WRITABLE = {"", "0", "false", "no", "off"}


def read_only() -> bool:
    """Whether ``KERNELCACHE_READONLY`` forbids writes (unset, 0, false, no, off: it does not)."""
    return os.environ.get("KERNELCACHE_READONLY", "").strip().lower() not in _WRITABLE


def folder_problem(folder: str) -> str | None:
    """Why memos in ``folder`` must not be used, or ``None`` (the cache directory's rule)."""
    try:
        st = os.stat(folder)  # a link the user chose as the cache directory is followed
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    return _fs.ownership_problem(st)


def read(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or ``None``: missing, damaged, foreign or in a refused folder."""
    if folder_problem(os.path.dirname(path)) is not None:
        return None
    try:
        fd = os.open(path, _READ)
    except OSError:
        return None  # missing, or a link planted in its place (ELOOP)
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not _own_file(st):
                return None
            data = json.loads(f.read(MAX_BYTES))
    except (OSError, ValueError):
        return None  # damaged: it is only a memo
    return data if isinstance(data, dict) else None


def write(path: str, data: dict[str, Any]) -> bool:
    """Replace the memo at ``path`` atomically; ``False`` when read-only, refused or failed."""
    if read_only():
        return False
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if folder_problem(folder) is not None:
            return False
        _fs.write_atomic(path, json.dumps(data, sort_keys=True).encode())
    except OSError:
        return False  # only a memo: the next process hashes again
    return True


@contextlib.contextmanager
def exclusive(path: str, timeout: float = 120.0) -> Iterator[bool]:
    """Hold ``<path>.lock`` while computing what goes into memo ``path``.

    N processes starting at once on an empty memo would each hash the same
    files (issue 23: 8 of them hash TileLang's 33 MB of headers 8 times, beside
    the one compile they wait for). The first computes; the others wait here,
    then find the memo written. Yields ``False`` (compute anyway, unlocked)
    when read-only, in a refused directory, or after ``timeout``.
    """
    folder = os.path.dirname(path)
    fd = None
    if not read_only():
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if folder_problem(folder) is None:
                fd = lockfile.open_lock_fd(f"{path}.lock")
                if not lockfile.lock_within(fd, timeout):
                    fd = None  # lock_within closed it
        except OSError:
            fd = None
    try:
        yield fd is not None
    finally:
        if fd is not None:
            lockfile.close_lock_fd(fd)  # closing releases the flock


def _own_file(st: os.stat_result) -> bool:
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & 0o022
        and st.st_size <= MAX_BYTES
    )
