"""Child processes for the launcher's callers, with ``os`` and ``select`` only.

A first compile through the warm server runs in a process the compiled client
started for this one call (:mod:`kernelcache.nvcc.compiling`). ``subprocess``
(with ``selectors``, ``signal``, ``threading`` and ``locale``), ``tempfile`` and
``shutil`` cost that process ~20 ms of imports on each cold object of a build
(issue 23). Here, nvcc and its dry run are started with ``posix_spawn`` and
their pipes read with ``poll``.

The children are started as ``subprocess`` would: ``SIGPIPE`` and ``SIGXFSZ``
back to their defaults (Python ignores them), a bare program name found on the
child's own ``PATH``. Unlike ``subprocess``, descriptors the caller inherited
stay open in them, as when the build runs nvcc itself.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.py imports enum: ~2 ms
import os
import select
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: its import costs this process ~10 ms
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

#: The status of a command that could not start, as a shell gives it.
CANNOT_RUN = 127

__all__ = ["CANNOT_RUN", "make_private_dir", "remove_tree", "run", "run_all"]

_DEFAULT_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ)


def run(
    argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None
) -> tuple[int, bytes, bytes] | None:
    """One command's ``(status, stdout, stderr)`` (see :func:`run_all`); ``None``: timed out."""
    return run_all([argv], env, timeout=timeout)[0]


def run_all(
    commands: Sequence[Sequence[str]],
    env: Mapping[str, str] | None = None,
    limit: int | None = None,
    timeout: float | None = None,
) -> list[tuple[int, bytes, bytes] | None]:
    """Run ``commands`` side by side, at most ``limit`` at once, each with its stdout and
    stderr collected: ``(status, stdout, stderr)`` in their order, the status as
    ``subprocess``'s ``returncode`` (minus the signal that ended it).

    A command that cannot start gets :data:`CANNOT_RUN` and a line saying why on its
    stderr. ``env``: the children's environment (default: this process's).
    ``timeout``: seconds for all of them; the children still running then are
    killed, and get ``None``.
    """
    environ = dict(os.environ if env is None else env)
    results: list[tuple[int, bytes, bytes] | None] = [None] * len(commands)
    waiting = list(range(len(commands)))[::-1]
    # Each running child: its pid and its two pipes, each with the chunks read so far.
    running: dict[int, tuple[int, dict[int, list[bytes]]]] = {}
    owner: dict[int, int] = {}  # pipe -> the child reading from it
    poller = select.poll()
    deadline = None if timeout is None else time.monotonic() + timeout
    slots = max(1, limit or len(commands))
    try:
        while waiting or running:
            while waiting and len(running) < slots:
                index = waiting.pop()
                started = _start(commands[index], environ)
                if isinstance(started, OSError):
                    why = f"kernelcache: cannot run {commands[index][0]}: {started}\n"
                    results[index] = (CANNOT_RUN, b"", os.fsencode(why))
                    continue
                running[index] = (started[0], {fd: [] for fd in started[1]})
                for fd in started[1]:
                    owner[fd] = index
                    poller.register(fd, select.POLLIN)
            if not running:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return results  # the finally kills what still runs
            events = poller.poll(None if left is None else int(left * 1000) + 1)
            for fd, _ in events:
                index = owner[fd]
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    running[index][1][fd].append(chunk)
                    continue
                poller.unregister(fd)
                os.close(fd)
                del owner[fd]
                pid, pipes = running[index]
                if all(other not in owner for other in pipes):
                    del running[index]
                    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                    out, err = (b"".join(chunks) for chunks in pipes.values())
                    results[index] = (status, out, err)
    finally:
        for fd in owner:
            os.close(fd)
        for pid, _ in running.values():
            _kill(pid)
    return results


def _start(argv: Sequence[str], env: dict[str, str]) -> tuple[int, tuple[int, int]] | OSError:
    """Start one child with its stdout and stderr to new pipes: ``(pid, (out, err))``."""
    program = _which(argv[0], env)
    if program is None:
        return FileNotFoundError(f"{argv[0]} is not on PATH")
    try:
        out_r, out_w = os.pipe()  # not inherited: only the dup2'd ends reach the child
    except OSError as exc:
        return exc
    try:
        err_r, err_w = os.pipe()
    except OSError as exc:
        os.close(out_r)
        os.close(out_w)
        return exc
    try:
        pid = os.posix_spawn(
            program,
            list(argv),
            env,
            file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)],
            setsigdef=_DEFAULT_SIGNALS,
        )
    except OSError as exc:
        os.close(out_r)
        os.close(err_r)
        return exc
    finally:
        os.close(out_w)
        os.close(err_w)
    return pid, (out_r, err_r)


def _which(name: str, env: Mapping[str, str]) -> str | None:
    """``name`` as ``subprocess`` would run it: a path as it is, a bare name found on the
    child's ``PATH``."""
    if os.sep in name:
        return name
    for directory in os.get_exec_path(env):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _kill(pid: int) -> None:
    try:  # noqa: SIM105 - contextlib costs this process more than its work
        os.kill(pid, _signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had exited: reaped below
    os.waitpid(pid, 0)


def make_private_dir(prefix: str = "kernelcache-") -> str:
    """A new directory only this user can enter, in ``TMPDIR`` or ``/tmp`` (``tempfile.mkdtemp``)."""
    parent = os.environ.get("TMPDIR") or "/tmp"
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(8).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return os.path.abspath(path)
    raise FileExistsError(f"no free name for a temporary directory in {parent}")


def remove_tree(path: str) -> None:
    """Remove ``path`` and what is in it, never following a link (``shutil.rmtree``,
    ignoring errors: a private temporary directory)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            _ignore(os.unlink, os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            _ignore(os.unlink if os.path.islink(full) else os.rmdir, full)
    _ignore(os.rmdir, path)


def _ignore(remove: Callable[[str], None], path: str) -> None:
    try:  # noqa: SIM105 - contextlib costs this process more than its work
        remove(path)
    except OSError:
        pass  # gone already, or left in the temporary directory, as rmtree(ignore_errors) does
