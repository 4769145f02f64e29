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
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from kernelcache import _dirs, _fs, _trust

#: A memo larger than this is damaged (or not ours): read as empty.
MAX_BYTES = 16 << 20

__all__ = ["MAX_BYTES", "load", "save"]


def load(name: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON object in memo file ``name`` of the cache directory; ``{}`` if none can be trusted."""
    try:
        dir_fd = _trust.open_dir(_dirs.cache_dir(environ))
    except (_trust.UntrustedDirectory, OSError):
        return {}
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


def save(name: str, doc: dict[str, Any], environ: dict[str, str] | None = None) -> bool:
    """Replace memo file ``name`` with ``doc`` atomically; ``False`` when nothing was written.

    Nothing is written when read-only, nor into a directory that is not
    trusted; a failure only costs the next process a recomputation.
    """
    if _dirs.read_only(environ):
        return False
    try:
        dir_fd = _trust.open_dir(_dirs.cache_dir(environ), create=True)
    except (_trust.UntrustedDirectory, OSError):
        return False
    if dir_fd is None:  # pragma: no cover - create=True makes it
        return False
    try:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        _fs.write_atomic(name, data, dir_fd=dir_fd)
    except OSError:
        return False
    finally:
        os.close(dir_fd)
    return True
