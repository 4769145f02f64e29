"""Memo files: small JSON documents in the cache directory that spare a fresh process work.

The toolchain probes' content hashes (``toolchain-probes.json``) and
TileLang's header-tree digests are memos: what they say goes into keys, so a
forged one would change every key built from it (issue 19). They follow the
rule entries follow (:mod:`kernelcache._trust`): read and written only in a
trusted cache directory, relative to its checked descriptor, never through a
link, and only when the file is this user's (or root's) and nobody else can
write it. ``KERNELCACHE_READONLY`` writes nothing at all, not even the
directory. Anything else (missing, damaged, refused) reads as an empty memo:
the caller computes again, and a refused directory is never written.

:func:`exclusive` holds ``<name>.lock`` beside a memo while one process
computes what goes into it: N processes starting at once on an empty memo
would each hash the same files (issue 23: 8 of them hash TileLang's 33 MB of
headers 8 times, beside the one compile they wait for).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Any

from kernelcache import _dirs, _fs, _trust

#: A memo larger than this is damaged (or not ours): read as empty.
MAX_BYTES = 16 << 20

__all__ = ["MAX_BYTES", "exclusive", "load", "save"]


def _open_dir(environ: Mapping[str, str] | None, *, write: bool = False) -> int | None:
    """A descriptor of the cache directory once trusted (made, to ``write``); ``None`` when
    missing, refused, or to write while read-only."""
    if write and _dirs.read_only(environ):
        return None
    try:
        return _trust.open_dir(_dirs.cache_dir(environ), create=write)
    except (_trust.UntrustedDirectory, OSError):
        return None


def load(name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The JSON object in memo file ``name`` of the cache directory; ``{}`` if none can be trusted."""
    dir_fd = _open_dir(environ)
    if dir_fd is None:
        return {}
    try:
        fd = _trust.open_file(dir_fd, name, os.O_RDONLY)
    except OSError:
        return {}  # missing, or a link: nothing to trust
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return {}
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
            return {}  # another user's file, or one others may write: not a memo of ours
        data = json.loads(os.pread(fd, st.st_size, 0))
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {}


def save(name: str, doc: dict[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Replace memo file ``name`` with ``doc`` atomically; ``False`` when nothing was written.

    Nothing is written when read-only, nor into a directory that is not
    trusted; a failure only costs the next process a recomputation.
    """
    dir_fd = _open_dir(environ, write=True)
    if dir_fd is None:
        return False
    try:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        _fs.write_atomic(name, data, dir_fd=dir_fd)
    except OSError:
        return False
    finally:
        os.close(dir_fd)
    return True


@contextlib.contextmanager
def exclusive(
    name: str, timeout: float = 120.0, environ: Mapping[str, str] | None = None
) -> Iterator[bool]:
    """Hold ``<name>.lock`` in the cache directory while computing what goes into memo ``name``.

    The first process computes; the others wait here, then find the memo
    written. Yields ``False`` (compute anyway, unlocked) when read-only, when
    the directory is not trusted, when the lock cannot be taken (no ``flock``
    on this filesystem) or after ``timeout`` seconds.
    """
    fd = _lock(name, timeout, environ)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            from kernelcache.stores import lockfile

            lockfile.close_lock_fd(fd)  # closing releases the flock


def _lock(name: str, timeout: float, environ: Mapping[str, str] | None) -> int | None:
    """The descriptor of ``<name>.lock``, locked; ``None`` where :func:`exclusive` yields ``False``."""
    dir_fd = _open_dir(environ, write=True)
    if dir_fd is None:
        return None
    # Imported here: the toolchain probes load memos at every key, and the
    # stores package costs its import only to processes that lock.
    from kernelcache.stores import lockfile

    try:
        # Through lockfile, so a forked child closes its copy and cannot keep our lock held.
        fd = lockfile.open_lock_fd(
            f"{name}.lock", lambda lock, flags: _trust.open_file(dir_fd, lock, flags)
        )
    except OSError:
        return None  # a link planted there (ELOOP), or no space: compute unlocked
    finally:
        os.close(dir_fd)
    try:
        return fd if lockfile.lock_within(fd, timeout) else None  # it closed fd if not
    except OSError:
        return None  # flock refused (no flock on this filesystem): fd is closed
