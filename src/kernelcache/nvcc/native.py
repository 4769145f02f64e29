"""The compiled launcher client (``client.c``): built by the server, run by ``kernelcache``.

Through the Python client a hit costs Python's start-up (~10 ms, most of a
ccache hit). ``client.c`` does what the script path of
:func:`kernelcache.nvcc.client.serve` does, as a small C program that
``bin/kernelcache`` runs instead when it finds it. Nothing builds it at
install time and nothing on a hit path: the server
(:mod:`kernelcache.nvcc.server`), once it listens, builds it in a background
thread (:func:`start`) when ``cc`` or ``gcc`` is on its ``PATH`` and this
source's binary for this host is missing:

- into the cache directory, which the server has checked is private to this
  user, as ``launcher-client-<16 hex of the source's SHA-256>-<host name>``:
  a binary of another version is never run (``bin/kernelcache`` names the
  one it expects), nor one built on another machine that shares the
  directory (another architecture or C library);
- statically linked where the C library allows it (it then runs in any
  container of this host), dynamically otherwise;
- under a temporary name, run once (it must print :data:`client.PROTOCOL`:
  it can run here, from this directory, and speaks this server's protocol),
  then mode 0700 and an atomic rename.

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
_HOST_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")

__all__ = [
    "ENV",
    "PREFIX",
    "SOURCE",
    "binary_name",
    "build",
    "host_name",
    "is_compiled_client",
    "prune",
    "source_hash",
    "start",
    "wanted",
]


def source_hash(source: bytes) -> str:
    """The 16 hex digits that name a binary of ``source``; ``bin/kernelcache`` embeds them."""
    return hashlib.sha256(source).hexdigest()[:16]


def host_name(path: str = "/proc/sys/kernel/hostname") -> str | None:
    """This machine's name as ``bin/kernelcache`` reads it; ``None`` if unusable in a file name."""
    try:
        with open(path, "rb") as f:
            name = f.read(256).split(b"\n", 1)[0].decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return name if name and set(name) <= _HOST_CHARS else None


def binary_name(source: bytes, host: str) -> str:
    return f"{PREFIX}{source_hash(source)}-{host}"


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


def start(directory: str, environ: Mapping[str, str]) -> threading.Thread | None:
    """Build this source's client for this host in the background, if it is missing and can be."""
    host = host_name()
    if sys.platform != "linux" or host is None:
        return None
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
    except OSError:
        return None  # an installation without the C source: the Python client serves
    name = binary_name(source, host)
    path = os.path.join(directory, name)
    prune(directory, name, time.time())
    if not wanted(environ) or os.path.exists(path):
        return None
    if os.path.exists(path + ".failed"):
        _log(f"the compiled client is not built again until {path}.failed is removed")
        return None
    compiler = next(filter(None, (shutil.which(c) for c in COMPILERS)), None)
    if compiler is None:
        _log(f"no C compiler ({', '.join(COMPILERS)}) on PATH: the Python client serves")
        return None
    thread = threading.Thread(target=build, args=(directory, name, compiler), daemon=True)
    thread.start()
    return thread


def prune(directory: str, keep: str, now: float) -> None:
    """Remove stale binaries, failure notes and temporaries; refresh ``keep``'s date."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(os.path.join(directory, keep), follow_symlinks=False)
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX) and n != keep]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        limit = TEMP_SECONDS if ".tmp." in name else STALE_SECONDS
        if now - st.st_mtime > limit and st.st_uid == os.getuid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def build(directory: str, name: str, compiler: str) -> bool:
    """Compile, check and install ``directory/name``; on failure log, count and remember it."""
    path = os.path.join(directory, name)
    temp = f"{path}.tmp.{_fs.unique()}"
    env = {k: v for k, v in os.environ.items() if k not in _COMPILER_VARS}
    env["LC_ALL"] = "C"
    log: list[str] = []
    try:
        for flags in FLAG_SETS:
            cmd = [compiler, *flags, "-o", temp, SOURCE]
            done = _step(cmd, env, directory)
            log.append(f"$ {' '.join(cmd)}\n{done.stdout}")
            if done.returncode == 0:
                break
        else:
            return _failed(directory, name, log)
        check = _step([temp, "--protocol"], env, directory)
        if check.returncode != 0 or check.stdout.strip() != PROTOCOL.decode():
            log.append(f"$ {temp} --protocol\nexit {check.returncode}: {check.stdout!r}")
            return _failed(directory, name, log)
        os.chmod(temp, 0o700)
        os.rename(temp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.append(f"{type(exc).__name__}: {exc}")
        return _failed(directory, name, log)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    _count(directory, "compiled_client_built")
    _log(f"built {path} ({' '.join(flags)})")
    return True


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


def _failed(directory: str, name: str, log: list[str]) -> bool:
    note = os.path.join(directory, name + ".failed")
    text = "\n".join(log)[-16384:]
    with contextlib.suppress(OSError):
        _fs.write_atomic(note, text.encode(), mode=0o600)
    _count(directory, "compiled_client_failed")
    _log(f"could not build the compiled client, the Python client serves:\n{text}")
    return False


def _log(message: str) -> None:
    print(f"kernelcache server: {message}", file=sys.stderr, flush=True)


def _count(directory: str, field: str) -> None:
    from kernelcache.settings import Settings
    from kernelcache.stats.launcher import count

    count(Settings.load(environ={"KERNELCACHE_DIR": directory}), field)
