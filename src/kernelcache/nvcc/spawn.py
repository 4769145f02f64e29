"""Starting the launcher's server (:mod:`kernelcache.nvcc.server`) for the next call.

The in-process launcher calls :func:`start` when no server answered its
client. Only here is anything written before a server runs, and only once
the directory passed the trust rule (:mod:`kernelcache._trust`, as the
server's own: this user's): the start marker, relative to the checked
descriptor, never through a link. The ``python -I -S`` client and the
compiled client start nothing (issue 19).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping

from kernelcache import _trust
from kernelcache.nvcc.client import RUN_MODULE, SOCKET

#: Values of ``KERNELCACHE_SERVER`` that turn the server off (``client.is_false``).
_OFF = ("0", "false", "no", "off")
#: Made by the process that starts a server, removed by the server once it listens.
STARTING = "launcher.starting"
#: A start marker older than this belongs to a start that failed: try again.
START_GRACE_NS = 10_000_000_000

__all__ = ["STARTING", "START_GRACE_NS", "start", "wake"]


def wake(directory: str, environ: Mapping[str, str]) -> bool:
    """Start the server for ``directory`` unless ``KERNELCACHE_SERVER`` is off (see :func:`start`)."""
    if environ.get("KERNELCACHE_SERVER", "").strip().lower() in _OFF or sys.platform != "linux":
        return False
    return start(directory, environ)


def start(directory: str, environ: Mapping[str, str]) -> bool:
    """Start the server for ``directory`` in the background, unless one is starting.

    Called by the in-process launcher when no server answered, after the
    directory passed the trust rule (as the server's own: this user's):
    nothing is written into a directory that is not trusted, and the start
    marker is made relative to the checked descriptor, never through a link.
    ``False`` when nothing was started.
    """
    try:
        dir_fd = _trust.open_dir(directory, allow_root=False, create=True)
    except (_trust.UntrustedDirectory, OSError):
        return False
    if dir_fd is None:  # pragma: no cover - create=True makes it
        return False
    try:
        if _listening(dir_fd) or not _claim_start(dir_fd):
            return False
    finally:
        os.close(dir_fd)
    env = {**environ, "KERNELCACHE_DIR": directory}
    # sh puts the server in the background and exits at once: the server is
    # then nobody's child (no zombie in a long-lived caller) and holds none of
    # the caller's pipes. It opens its log itself, once it has checked the directory.
    # RUN_MODULE: as ``python -m`` would, without the caller's (a build's) directory on sys.path.
    script = 'exec "$0" -c "$2" "$1" </dev/null >/dev/null 2>&1 &'
    argv = [
        "/bin/sh",
        "-c",
        script,
        sys.executable,
        directory,
        RUN_MODULE % "kernelcache.nvcc.server",
    ]
    try:
        pid = os.posix_spawn("/bin/sh", argv, env)
        os.waitpid(pid, 0)
    except OSError:
        return False
    return True


def _listening(dir_fd: int) -> bool:
    """Whether a server accepts on the socket (it reads an empty request and counts nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(f"/proc/self/fd/{dir_fd}/{os.fsdecode(SOCKET)}")
        except OSError:
            return False
    return True


def _claim_start(dir_fd: int) -> bool:
    """Make the start marker; ``False`` when another start, younger than the grace, holds it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        os.close(_trust.open_file(dir_fd, STARTING, flags))
        return True
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.stat(STARTING, dir_fd=dir_fd, follow_symlinks=False)
        if st.st_mtime_ns > time.time_ns() - START_GRACE_NS:
            return False  # another process started one a moment ago
        os.unlink(STARTING, dir_fd=dir_fd)
        os.close(_trust.open_file(dir_fd, STARTING, flags))
    except OSError:
        return False
    return True
