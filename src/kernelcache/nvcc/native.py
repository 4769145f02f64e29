"""The compiled launcher client (``client.c``): built by the server, run by ``kernelcache``.

Through the Python client a hit costs Python's start-up (~10 ms, most of a
ccache hit). ``client.c`` does what the script path of
:func:`kernelcache.nvcc.client.serve` does, as a small C program that
``bin/kernelcache`` runs instead when it finds it. Nothing builds it at
install time and nothing on a hit path: the server
(:mod:`kernelcache.nvcc.server`), once it listens, builds it in a background
thread (:func:`start`) when ``cc`` or ``gcc`` is on its ``PATH`` and this
source's binary for this host is missing:

- into the cache directory, which the server has checked by the trust rule
  (:mod:`kernelcache._trust`: this user's own, every ancestor trusted), as
  ``launcher-client-<16 hex of the source's SHA-256>-<machine>-<system>-<libc>-<host>``
  (:func:`platform_tag`): a binary of another version is never run
  (``bin/kernelcache`` names the one it expects), nor one built on a machine
  of another architecture or C library that shares the directory;
- statically linked where the C library allows it (it then runs in any
  container of this host), dynamically otherwise;
- under a temporary name, run once (it must print :data:`client.PROTOCOL`:
  it can run here, from this directory, and speaks this server's protocol),
  then mode 1700 (:data:`MODE`: the sticky bit says "a client this user's
  server built", which the front checks on the file it opened) and an
  atomic rename;
- marked for this boot (:func:`mark_name`: a hard link ``<name>.ok-<boot id>``,
  the very same file). The front runs only a marked client: a binary that a
  same-named machine left under this name and that cannot start here (its
  C library's version is not in the name) is never run; the server checks
  it (:func:`ensure`: run once), and removes and rebuilds what does not run.

How ``bin/kernelcache`` runs it, and why that is safe although a shell cannot
``fexecve``: it opens the file on descriptor 9, checks *that open file*
(``/proc/self/fd/9``: regular, executable, this user's, with the sticky
mark, the same file as this boot's mark) and executes ``/proc/self/fd/9``,
which is what glibc's ``fexecve`` does without ``execveat``: what runs is the
file checked, whatever happens to the path meanwhile. Another user who can
change the path (a parent they can write) can then only make it run a file
of this user's that this user's server marked: a kernelcache client, which
checks the directory and every ancestor itself (``client.c``), and that it
is that directory's own file, before it asks anything; failing that it hands
over to the in-process launcher, which refuses the directory and compiles
with plain nvcc. Opening a planted FIFO could still block the front: that
costs a build its progress, not its safety, and needs a directory others
can write, which the launcher warns about on every call.

Built once per user and machine, not once per cache directory (issue 40: a
fresh CI runner's first build into an empty cache directory paid for it):
the server builds it into a per-user folder shared by every cache directory
(:func:`shared_dir`: ``KERNELCACHE_CLIENT_DIR``, else
``$XDG_CACHE_HOME/kernelcache-clients``, else ``~/.cache/kernelcache-clients``;
held to the same trust rule), and a cache directory gets a hard link to it
(a copy across file systems), checked and marked as above. The compiler runs
at the lowest priority (``nice``), beside the build that started the server.

A failed build is logged in ``launcher.log``, counted
(``compiled_client_failed`` in the launcher statistics) and remembered in
``<name>.failed`` with the compiler's output: it is not tried again for this
source and host until that file is removed. Without a compiler nothing
happens and the Python client serves, as before; so it does when the server
was started with ``KERNELCACHE_COMPILED_CLIENT=0``, which stops it building
one (remove ``launcher-client-*`` from the cache directory to stop using one
already built).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from kernelcache import _fs
from kernelcache.nvcc.client import PROTOCOL

PREFIX = "launcher-client-"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.c")
ENV = "KERNELCACHE_COMPILED_CLIENT"
#: The per-user folder every cache directory's client comes from (:func:`shared_dir`).
SHARED_ENV = "KERNELCACHE_CLIENT_DIR"
COMPILERS = ("cc", "gcc")
#: Static first (no C library to match at run time, and no loader: faster too).
FLAG_SETS = (("-O2", "-static"), ("-O2",))
#: Each compile, and the binary's self-test, gets at most this long.
STEP_TIMEOUT = 120.0
#: Other versions' and hosts' binaries not refreshed for this long are removed.
STALE_SECONDS = 30 * 86400.0
#: A temporary file older than this belongs to a build that died.
TEMP_SECONDS = 3600.0
#: What gcc reads from the environment: a user's CPATH must not break the build.
_COMPILER_VARS = ("CPATH", "C_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")
#: The client's mode: the sticky bit (no meaning on a regular file for Linux) marks a
#: client this user's server built, which ``bin/kernelcache`` checks before it runs one.
MODE = 0o1700
#: Between a binary's name and the boot id of its mark (:func:`mark_name`).
MARK = ".ok-"
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")

__all__ = [
    "ENV",
    "PREFIX",
    "SOURCE",
    "binary_name",
    "boot_id",
    "build",
    "check",
    "ensure",
    "host_name",
    "is_compiled_client",
    "mark_name",
    "marked",
    "platform_tag",
    "prune",
    "shared_dir",
    "source_hash",
    "start",
    "wanted",
]


def source_hash(source: bytes) -> str:
    """The 16 hex digits that name a binary of ``source``; ``bin/kernelcache`` embeds them."""
    return hashlib.sha256(source).hexdigest()[:16]


def _proc_word(path: str) -> str | None:
    """The first line of ``path`` (a ``/proc`` file) if usable in a file name, else ``None``."""
    try:
        with open(path, "rb") as f:
            word = f.read(256).split(b"\n", 1)[0].decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return word if word and set(word) <= _NAME_CHARS else None


def host_name(path: str = "/proc/sys/kernel/hostname") -> str | None:
    """This machine's name as ``bin/kernelcache`` reads it; ``None`` if unusable in a file name."""
    return _proc_word(path)


def platform_tag(proc: str = "/proc/sys/kernel", root: str = "/") -> str | None:
    """``MACHINE-SYSTEM-LIBC-HOST``, as ``bin/kernelcache`` reads them without starting a program.

    The machine (``uname -m``, from ``kernel.arch``; ``unknown`` on kernels
    without it), the system (``uname -s``), the C library's family (``musl``
    where its loader is, else ``gnu``) and the host name (issue 19): two
    machines of one host name but another architecture or C library never
    share a binary. Its version is not in the name (the front cannot learn
    it without starting a program); the mark of :func:`check` covers it.
    """
    host, system = _proc_word(f"{proc}/hostname"), _proc_word(f"{proc}/ostype")
    machine = _proc_word(f"{proc}/arch") or "unknown"
    if host is None or system is None:
        return None
    libc = "musl" if os.path.exists(f"{root}lib/ld-musl-{machine}.so.1") else "gnu"
    return f"{machine}-{system}-{libc}-{host}"


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str | None:
    """This boot's random id: what tells one machine from another of the same name."""
    return _proc_word(path)


def binary_name(source: bytes, tag: str) -> str:
    """The client's file name for ``source`` on a machine of :func:`platform_tag` ``tag``."""
    return f"{PREFIX}{source_hash(source)}-{tag}"


def mark_name(name: str, boot: str) -> str:
    """The hard link that says binary ``name`` ran on the machine of boot ``boot``."""
    return f"{name}{MARK}{boot}"


def is_compiled_client(pid: int) -> bool:
    """Whether process ``pid`` (a connected client) runs a compiled client."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(PREFIX)
    except OSError:
        return False


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``KERNELCACHE_COMPILED_CLIENT`` lets the server build one (it does unless 0/off)."""
    value = environ.get(ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


def marked(directory: str, name: str, boot: str) -> bool:
    """Whether ``name`` ran here since this boot: its mark is the very same file."""
    try:
        st = os.lstat(os.path.join(directory, name))
        mark = os.lstat(os.path.join(directory, mark_name(name, boot)))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (mark.st_dev, mark.st_ino)


def start(directory: str, environ: Mapping[str, str]) -> threading.Thread | None:
    """Check, or build, this source's client for this machine in the background, if needed.

    ``directory`` must have passed the trust rule (:mod:`kernelcache._trust`;
    the server's own check): everything here is done by path inside it.
    """
    tag, boot = platform_tag(), boot_id()
    if sys.platform != "linux" or tag is None or boot is None:
        return None
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
    except OSError:
        return None  # an installation without the C source: the Python client serves
    name = binary_name(source, tag)
    path = os.path.join(directory, name)
    prune(directory, name, time.time())
    if not wanted(environ) or marked(directory, name, boot):
        return None
    if os.path.exists(path + ".failed"):
        _log(f"the compiled client is not built again until {path}.failed is removed")
        return None
    shared = shared_dir(environ)
    if shared is not None:
        prune(shared, name, time.time())
    compiler = next(filter(None, (shutil.which(c) for c in COMPILERS)), None)
    if compiler is None and not os.path.lexists(path) and not _has(shared, name):
        _log(f"no C compiler ({', '.join(COMPILERS)}) on PATH: the Python client serves")
        return None
    args = (directory, name, compiler, boot, shared)
    thread = threading.Thread(target=ensure, args=args, daemon=True)
    thread.start()
    return thread


def shared_dir(environ: Mapping[str, str]) -> str | None:
    """The per-user folder clients are built in once (see the module docstring), made if
    missing; ``None`` when ``environ`` names none or it fails the trust rule."""
    from kernelcache import _trust

    folder = environ.get(SHARED_ENV, "")
    if not folder:
        xdg, home = environ.get("XDG_CACHE_HOME", ""), environ.get("HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(home, ".cache") if home else ""
        if not base:
            return None
        folder = os.path.join(base, "kernelcache-clients")
    folder = os.path.abspath(folder)
    try:
        fd = _trust.open_dir(folder, allow_root=False, create=True)
    except (_trust.UntrustedDirectory, OSError) as exc:
        _log(f"no shared folder for the compiled client ({exc}): built per cache directory")
        return None
    if fd is None:  # pragma: no cover - create=True makes it
        return None
    os.close(fd)
    return folder


def _has(folder: str | None, name: str) -> bool:
    return folder is not None and os.path.lexists(os.path.join(folder, name))


def ensure(
    directory: str,
    name: str,
    compiler: str | None,
    boot: str,
    shared: str | None = None,
    counts: str | None = None,
) -> bool:
    """Mark ``name`` if it runs here; otherwise (a binary of a same-named machine that cannot
    start here, a damaged one) remove it and take it from ``shared``, building it there
    first if needed (without ``shared``: build it in ``directory``; issues 19, 40).
    ``counts``: the cache directory whose statistics count a build (``directory``'s own)."""
    path = os.path.join(directory, name)
    if os.path.lexists(path):
        if check(directory, name, boot):
            return True
        _log(f"{path} does not run on this machine: it is built again")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if shared is not None and os.path.realpath(shared) != os.path.realpath(directory):
        if os.path.exists(os.path.join(shared, name + ".failed")):
            _log(f"the compiled client is not built again until {shared}/{name}.failed is removed")
            return False
        ready = marked(shared, name, boot) or ensure(shared, name, compiler, boot, counts=directory)
        return ready and _adopt(shared, directory, name) and check(directory, name, boot)
    return compiler is not None and build(directory, name, compiler, counts=counts)


def _adopt(shared: str, directory: str, name: str) -> bool:
    """Put ``shared/name`` into ``directory`` under its name: a hard link to the same file
    (its mode and owner come along), or a copy across file systems."""
    source, temp = os.path.join(shared, name), os.path.join(directory, f"{name}.tmp.{_fs.unique()}")
    try:
        try:
            os.link(source, temp)
        except OSError:
            shutil.copyfile(source, temp)  # another file system, or no hard links there
            os.chmod(temp, MODE)
        os.rename(temp, os.path.join(directory, name))
    except OSError as exc:
        _log(f"could not take the compiled client from {shared}: {exc}")
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return True


def check(directory: str, name: str, boot: str | None = None) -> bool:
    """Whether ``directory/name`` is a file of this user's that runs here and speaks this
    protocol; if so, mark it for this boot (``bin/kernelcache`` runs only a marked client)."""
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        done = _step([path, "--protocol"], _build_env(), directory)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0 or done.stdout.strip() != PROTOCOL.decode():
        return False
    boot = boot or boot_id()
    return boot is None or _mark(directory, name, boot)


def _mark(directory: str, name: str, boot: str) -> bool:
    """Link ``name``'s mark for ``boot`` to it (replacing a stale one); ``False`` if links fail."""
    path = os.path.join(directory, name)
    temp = f"{path}.tmp.{_fs.unique()}"
    try:
        os.link(path, temp)
        os.replace(temp, os.path.join(directory, mark_name(name, boot)))
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        return False  # no hard links here: the Python client serves
    return True


def prune(directory: str, keep: str, now: float) -> None:
    """Remove stale binaries, marks, failure notes and temporaries; refresh ``keep``'s date.

    A mark of ``keep`` that is not ``keep`` itself any more (it was built
    again) is removed at once.
    """
    with contextlib.suppress(FileNotFoundError):
        os.utime(os.path.join(directory, keep), follow_symlinks=False)
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX) and n != keep]
    except OSError:
        return
    try:
        current: os.stat_result | None = os.lstat(os.path.join(directory, keep))
    except OSError:
        current = None
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if name.startswith(keep + MARK) and ".tmp." not in name:
            stale = current is None or (st.st_dev, st.st_ino) != (current.st_dev, current.st_ino)
        else:
            limit = TEMP_SECONDS if ".tmp." in name else STALE_SECONDS
            stale = now - st.st_mtime > limit
        if stale and st.st_uid == os.getuid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _build_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _COMPILER_VARS}
    env["LC_ALL"] = "C"
    return env


def build(directory: str, name: str, compiler: str, counts: str | None = None) -> bool:
    """Compile, check, install and mark ``directory/name``; on failure log, count (into
    ``counts``, else ``directory``) and remember it."""
    path = os.path.join(directory, name)
    counts = counts or directory
    temp = f"{path}.tmp.{_fs.unique()}"
    env = _build_env()
    log: list[str] = []
    try:
        for flags in FLAG_SETS:
            cmd = [compiler, *flags, "-o", temp, SOURCE]
            done = _step([*_NICE, *cmd], env, directory)
            log.append(f"$ {' '.join(cmd)}\n{done.stdout}")
            if done.returncode == 0:
                break
        else:
            return _failed(directory, name, log, counts)
        check = _step([temp, "--protocol"], env, directory)
        if check.returncode != 0 or check.stdout.strip() != PROTOCOL.decode():
            log.append(f"$ {temp} --protocol\nexit {check.returncode}: {check.stdout!r}")
            return _failed(directory, name, log, counts)
        os.chmod(temp, MODE)
        os.rename(temp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.append(f"{type(exc).__name__}: {exc}")
        return _failed(directory, name, log, counts)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    _count(counts, "compiled_client_built")
    _log(f"built {path} ({' '.join(flags)})")
    boot = boot_id()
    if boot is not None:
        _mark(directory, name, boot)
    return True


#: The build runs beside the build that started the server (a first miss's nvcc): last.
_NICE_PATH = shutil.which("nice")
_NICE = (_NICE_PATH, "-n", "19") if _NICE_PATH else ()


def _step(cmd: list[str], env: dict[str, str], cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        timeout=STEP_TIMEOUT,
        check=False,
    )


def _failed(directory: str, name: str, log: list[str], counts: str) -> bool:
    note = os.path.join(directory, name + ".failed")
    text = "\n".join(log)[-16384:]
    with contextlib.suppress(OSError):
        _fs.write_atomic(note, text.encode(), mode=0o600)
    _count(counts, "compiled_client_failed")
    _log(f"could not build the compiled client, the Python client serves:\n{text}")
    return False


def _log(message: str) -> None:
    print(f"kernelcache server: {message}", file=sys.stderr, flush=True)


def _count(directory: str, field: str) -> None:
    from kernelcache.settings import Settings
    from kernelcache.stats.launcher import count

    count(Settings.load(environ={"KERNELCACHE_DIR": directory}), field)
