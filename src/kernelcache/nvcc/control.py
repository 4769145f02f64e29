"""The launcher's server seen from outside: whether one runs, its settings, stopping it.

One server runs per cache directory (:mod:`kernelcache.nvcc.server`): it holds an
``flock`` on ``DIR/launcher.lock`` and writes its pid and idle timeout into it. The
CLI (``kernelcache server status|stop``) and the tests read that lock here, without
importing the server and the cache behind it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import time

DEFAULT_IDLE = 600.0
#: The server's output, appended (it opens it itself, once the directory is checked).
LOG = "launcher.log"
#: Held (flock) by the running server, which writes ``"PID IDLE\n"`` into it.
LOCK = "launcher.lock"

__all__ = ["DEFAULT_IDLE", "LOCK", "LOG", "idle_seconds", "running", "stop"]


def idle_seconds(environ: dict[str, str] | os._Environ[str]) -> float:
    """``KERNELCACHE_SERVER_IDLE`` seconds (default 600); a bad value gives the default."""
    try:
        value = float(environ.get("KERNELCACHE_SERVER_IDLE", DEFAULT_IDLE))
    except ValueError:
        return DEFAULT_IDLE
    return value if value > 0 else DEFAULT_IDLE


def running(directory: str) -> tuple[int, float | None] | None:
    """``(pid, idle seconds)`` of the server holding ``directory``, or ``None`` if none runs."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _try_lock(fd):
            return None
        fields = os.pread(fd, 64, 0).split()
    finally:
        os.close(fd)
    try:
        idle = float(fields[1]) if len(fields) > 1 else None  # written since issue 20
        return int(fields[0]), idle
    except (IndexError, ValueError):
        return 0, None  # held, its pid not written yet (the server is starting)


def stop(directory: str, timeout: float = 10.0) -> bool:
    """Stop the server of ``directory`` (SIGTERM) and wait for it; ``False`` if none runs."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False  # a link where the lock belongs: no server of ours holds it
        raise
    try:
        if _try_lock(fd):
            return False
        deadline = time.monotonic() + timeout
        pid = 0
        while True:
            # Read again each time: a server that has just taken the lock has not written
            # its pid yet (the file is empty, or still names the server before it).
            written = _pid(fd)
            if written is not None and written != pid:
                pid = written
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            if _try_lock(fd):
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server of {directory} (pid {pid}) did not exit in {timeout:g} s"
                    f" (state: {_state(pid)})"
                )
            time.sleep(0.01)
    finally:
        os.close(fd)


def _pid(fd: int) -> int | None:
    """The pid written in the lock file, or ``None`` while none is."""
    fields = os.pread(fd, 32, 0).split()
    return int(fields[0]) if fields and fields[0].isdigit() and int(fields[0]) > 0 else None


def _state(pid: int) -> str:
    """The process's scheduler state and wait channel, for a stop that timed out."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0].decode()
        with open(f"/proc/{pid}/wchan", "rb") as f:
            return f"{state}, waiting in {f.read().decode() or '-'}"
    except (OSError, IndexError, UnicodeDecodeError):
        return "gone or unreadable"


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True
