"""The launcher's client: the ``kernelcache`` executable's way to the server.

``bin/kernelcache`` (installed as ``kernelcache``, next to pip's
``kernelcache-cli`` console script) runs, for a launcher call, the compiled
client the server has built (``client.c``, :mod:`kernelcache.nvcc.native`),
which does in C what the script path of :func:`serve` does: a change here
is made there too (tests/test_launcher_compiled.py compares what the two
send and answer). Without it, the front starts this module with the
interpreter pip chose, without ``site`` (``-I -S``: ``python -c pass``
costs ~12-16 ms here, ``python -I -S -c pass`` ~9-11 ms, and a ccache hit
~11-13 ms). ``python -m kernelcache`` and ``kernelcache-cli`` come here
too (:func:`main`).

It imports only what the interpreter has built in (``posix``, ``_socket``),
asks the per-user server (:mod:`kernelcache.nvcc.server`) through the Unix
socket ``launcher.sock`` in the cache directory, and:

- on a hit, the server has written the outputs: print nvcc's stdout and
  stderr as they were and exit with nvcc's status;
- for an uncacheable call (already counted by the server), run nvcc itself;
- otherwise (a miss, no server, a server that died mid-request or answered
  something else) run the launcher in-process (:mod:`kernelcache.nvcc.launcher`;
  from the script, by starting the interpreter on :mod:`kernelcache.nvcc.launcher`), which
  is correct without any server. The launcher starts a missing server for the
  next call once the directory passed the trust rule: this module writes
  nothing, and runs nothing from the cache directory (issue 19).

The socket must be a socket owned by this user, and so must be the process
at its other end (``SO_PEERCRED``). Messages are length-prefixed byte strings,
never pickle (:func:`pack`, :func:`unpack`). ``KERNELCACHE_SERVER=0`` turns
the server off.
"""

import _socket
import posix
import sys
from posix import _exit as exit_now  # os._exit, without importing os

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the client imports nothing it can avoid
if TYPE_CHECKING:
    from collections.abc import Callable

#: ``python -c`` code that runs a module as ``python -m`` would, without the current
#: directory first on ``sys.path``: a build directory's own ``kernelcache.py`` (or
#: ``logging.py``) must never run in place of the launcher or the server, nor break
#: them. ``-c`` names that directory ``''``, first, unless ``-P``, ``-I`` or
#: ``PYTHONSAFEPATH`` left it out; ``-P`` itself exists from Python 3.11 only.
RUN_MODULE = (
    "import runpy, sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n"
    "runpy.run_module('%s', run_name='__main__', alter_sys=True)"
)
#: ``python -c`` code for the launcher (:mod:`kernelcache.nvcc.launcher`): the way of
#: :data:`RUN_MODULE`, but a first compile through the server (:mod:`kernelcache.nvcc.compiling`)
#: is tried before ``runpy`` is imported, ~8 ms of each cold object's start (issue 23).
#: (client.c carries it: RUN_LAUNCHER.)
RUN_LAUNCHER = (
    "import sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n"
    "from kernelcache.nvcc import compiling\n"
    "compiling.main(sys.argv[1:])\n"
    "from kernelcache.nvcc import launcher\n"
    "sys.exit(launcher.main(sys.argv[1:]))"
)
#: Both ends check it: a server of another version answers "fallback" and exits.
PROTOCOL = b"kernelcache-launcher/2"
SOCKET = b"launcher.sock"
#: How long a client waits for its answer before compiling by itself
#: (``KERNELCACHE_SERVER_TIMEOUT`` seconds).
REPLY_TIMEOUT = 120.0
_SUN_PATH_MAX = 107


def pack(items: list[bytes]) -> bytes:
    """A message: its length (8 bytes), then each item as a 4-byte length and its bytes."""
    body = b"".join(len(item).to_bytes(4, "big") + item for item in items)
    return len(body).to_bytes(8, "big") + body


def unpack(body: bytes) -> list[bytes]:
    """The items of a message body (without its 8-byte length); ``ValueError`` if malformed."""
    items, i = [], 0
    while i < len(body):
        n = int.from_bytes(body[i : i + 4], "big")
        if i + 4 + n > len(body):
            raise ValueError("truncated message")
        items.append(body[i + 4 : i + 4 + n])
        i += 4 + n
    return items


def receive(sock: _socket.socket, limit: int = 1 << 62) -> list[bytes] | None:
    """One message from ``sock``; ``None`` if the peer closed before its end.

    ``ValueError`` for a message that announces more than ``limit`` bytes.
    """
    data = b""
    while len(data) < 8:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    size = int.from_bytes(data[:8], "big")
    if size > limit:
        raise ValueError(f"a message of {size} bytes (at most {limit})")
    parts, have = [data[8:]], len(data) - 8
    while have < size:
        chunk = sock.recv(max(65536, size - have))
        if not chunk:
            return None
        parts.append(chunk)
        have += len(chunk)
    return unpack(b"".join(parts)[:size])


def cache_dir(env: dict[bytes, bytes], cwd: bytes) -> bytes | None:
    """The cache directory ``Settings.load().dir`` gives, made absolute; ``None`` if unsure.

    The same rules as ``kernelcache.settings.default_dir`` on Linux (the XDG
    spec); elsewhere, or with ``~user`` paths, the launcher runs in-process.
    """
    value = env.get(b"KERNELCACHE_DIR")
    if value is None:
        if sys.platform != "linux" or hasattr(sys, "getandroidapilevel"):
            return None
        if b"ANDROID_DATA" in env:
            return None
        xdg = env.get(b"XDG_CACHE_HOME", b"")
        if xdg.startswith(b"/"):
            return xdg.rstrip(b"/") + b"/kernelcache"
        home = env.get(b"HOME", b"")
        if xdg.strip() or not home.startswith(b"/"):
            return None
        return (home.rstrip(b"/") or b"") + b"/.cache/kernelcache"
    if value == b"~" or value.startswith(b"~/"):
        home = env.get(b"HOME", b"")
        if not home.startswith(b"/"):
            return None
        value = home.rstrip(b"/") + value[1:]
    elif not value.startswith(b"/"):
        return None  # relative: the settings refuse it, and the in-process launcher says so
    return value


def _environ() -> dict[bytes, bytes]:
    # posix.environ is a snapshot taken at start-up; an importing process may
    # have changed its environment since (os.environ), a script has not.
    os = sys.modules.get("os")
    return posix.environ if os is None else dict(os.environb)


def _fsencode(text: str) -> bytes:
    return text.encode(sys.getfilesystemencoding(), "surrogateescape")


def _fsdecode(data: bytes) -> str:
    return data.decode(sys.getfilesystemencoding(), "surrogateescape")


def is_false(value: bytes | None) -> bool:
    return value is not None and value.strip().lower() in (b"0", b"false", b"no", b"off")


def is_true(value: bytes | None) -> bool:
    return value is not None and value.strip().lower() in (b"1", b"true", b"yes", b"on")


def _timeout(value: bytes | None) -> float:
    try:
        seconds = float(value) if value is not None else REPLY_TIMEOUT
    except ValueError:
        return REPLY_TIMEOUT
    return seconds if seconds > 0 else REPLY_TIMEOUT


def connect(directory: bytes, timeout: float) -> _socket.socket | None:
    """A connection to this user's server for ``directory``; ``None`` if there is none."""
    path = directory + b"/" + SOCKET
    try:
        st = posix.lstat(path)
    except OSError:
        return None
    if st.st_mode & 0o170000 != 0o140000 or st.st_uid != posix.getuid():
        return None  # not a socket, or not ours: never talk to it
    fd = -1
    if len(path) > _SUN_PATH_MAX:  # sun_path is short; reach it through the directory
        try:
            fd = posix.open(directory, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_CLOEXEC)
        except OSError:
            return None
        path = b"/proc/self/fd/%d/" % fd + SOCKET
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        cred = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        if int.from_bytes(cred[4:8], sys.byteorder) != posix.getuid():
            sock.close()
            return None
    except OSError:
        sock.close()
        return None
    finally:
        if fd >= 0:
            posix.close(fd)
    return sock


def ask(
    directory: bytes,
    argv: list[bytes],
    cwd: bytes,
    head: list[bytes] | None = None,
    most: float | None = None,
) -> list[bytes] | None:
    """The server's answer to this call, or ``None`` when no server could give one.

    ``head``: what comes before the call (default: :data:`PROTOCOL`; a
    compile step's, :mod:`kernelcache.nvcc.compiling`); ``most``: seconds to
    wait at most, below ``KERNELCACHE_SERVER_TIMEOUT``.
    """
    timeout = _timeout(_environ().get(b"KERNELCACHE_SERVER_TIMEOUT"))
    sock = connect(directory, timeout if most is None else min(timeout, most))
    if sock is None:
        return None
    env = [k + b"=" + v for k, v in _environ().items()]
    umask = posix.umask(0o022)  # read it (the only way), then put it back
    posix.umask(umask)
    request = [*(head or [PROTOCOL]), cwd, directory, b"%d" % umask, b"%d" % len(argv), *argv, *env]
    try:
        sock.sendall(pack(request))
        return receive(sock)
    except (OSError, ValueError):
        return None  # a server that died or hung mid-request: compile without it
    finally:
        sock.close()


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (a pipe may take it in parts)."""
    while data:
        data = data[posix.write(fd, data) :]


def serve(
    argv: list[str],
    local: "Callable[[list[str]], int]",
    plain: "Callable[[str, list[str]], int]",
) -> int:
    """Run ``argv`` through the server; ``local(argv)`` and ``plain(nvcc, args)`` otherwise."""
    env = _environ()
    cwd = posix.getcwdb()
    # Read-only writes nothing into the cache directory, and a server would
    # (its socket, lock and log live there): the launcher runs in-process.
    off = is_false(env.get(b"KERNELCACHE_SERVER")) or is_true(env.get(b"KERNELCACHE_READONLY"))
    directory = None if off else cache_dir(env, cwd)
    reply = None
    if directory is not None:
        reply = ask(directory, [_fsencode(a) for a in argv], cwd)
    if reply and reply[0] == b"hit" and len(reply) == 4:
        for fd, data in ((1, reply[2]), (2, reply[3])):
            write_all(fd, data)
        return int(reply[1])
    if reply and reply[0] == b"plain" and len(reply) == 2:
        return plain(_fsdecode(reply[1]), argv[1:])
    return local(argv)


def _script_local(argv: list[str]) -> int:
    # The package is not importable without site: a new interpreter with it.
    python = sys.executable
    posix.execv(python, [python, "-c", RUN_LAUNCHER, *argv])
    return 127


def _script_plain(nvcc: str, args: list[str]) -> int:
    try:
        posix.execv(nvcc, [nvcc, *args])
    except OSError as exc:
        write_all(2, b"kernelcache: cannot run %s: %s\n" % (_fsencode(nvcc), str(exc).encode()))
    return 127


def script_main() -> int:
    """``bin/kernelcache``'s entry: ``sys.argv`` is ``[script, nvcc, args...]``.

    Exits at once: everything was written with ``posix.write`` (nothing is
    buffered), and the interpreter's clean-up would cost ~1 ms per hit.
    """
    exit_now(serve(sys.argv[1:], _script_local, _script_plain))
