"""The launcher's server: one warm process per user and cache directory that answers hits.

Started on demand (:func:`kernelcache.nvcc.spawn.start`, by the in-process launcher when no server
answered its client) as ``python -m kernelcache.nvcc.server DIR``, in its own
session. It checks ``DIR`` first (:mod:`kernelcache._trust`: this user's, and
every ancestor trusted), then makes every file relative to that checked
descriptor, never through a link: its output appended to ``DIR/launcher.log``,
its lock, and ``DIR/launcher.sock`` (mode 0600), on which it serves
one request at a time: it enters the client's working directory, reads
the client's environment from the request, and does the direct lookup with
a real :class:`~kernelcache.cache.Cache` over the disk (and remote) tiers,
so its hits are counted where every other hit is. A hit's outputs are
written here; nvcc's stdout, stderr and status go back to the client. An
uncacheable call is counted here and the client runs nvcc. A miss is planned
here and compiled by the caller (:mod:`kernelcache.nvcc.compiling`: the
caller preprocesses when a preprocessed key may hold the result, the server
looks it up and stores the compile); anything else (a bad setting, no
answer) is the client's to run in-process. What it learns
stays warm: the toolchain identities, the parsed settings, and the content
digests of files whose stat signature is unchanged and old enough to trust.

Only one server runs per directory (an flock on ``DIR/launcher.lock``). It
exits after ``KERNELCACHE_SERVER_IDLE`` seconds without a request (default
600), when its socket is removed or replaced, on SIGTERM, or when a client
speaks a newer protocol version (the next client starts a new one); an
older or unknown protocol gets ``fallback`` and the server stays, so two
versions sharing a directory never make servers exit in turn. No memory
tier: a manifest another process updated must be seen at once.

Once it listens, it builds the compiled client in the background when it
can (:mod:`kernelcache.nvcc.native`). As it exits it logs why, how many
answers of each kind it gave, and how many of them went to the compiled client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from kernelcache import _trust
from kernelcache.cache import Cache
from kernelcache.errors import KernelCacheError
from kernelcache.nvcc.args import parse
from kernelcache.nvcc.client import PROTOCOL, SOCKET, pack, receive
from kernelcache.nvcc.compiling import COMPILE
from kernelcache.nvcc.control import LOCK, LOG, idle_seconds
from kernelcache.nvcc.flight import Flying
from kernelcache.nvcc.job import Job, Outcome, lookup, saved_seconds
from kernelcache.nvcc.key import Identities, resolve_compiler
from kernelcache.nvcc.native import is_compiled_client
from kernelcache.nvcc.native import start as start_build
from kernelcache.nvcc.outputs import messages, write_outputs
from kernelcache.nvcc.spawn import STARTING
from kernelcache.settings import Settings
from kernelcache.tiers import default_tiers

if TYPE_CHECKING:
    from kernelcache.entry import Entry

#: Settings a server keeps a Cache open for (a client may set KERNELCACHE_REMOTE, ...).
MAX_CACHES = 4
_TICK = 1.0
#: A client sends its request as soon as it connects; one that does not
#: must not hold the (one-at-a-time) server for long.
_REQUEST_TIMEOUT = 5.0
#: A request is a command line and an environment: far below this.
_REQUEST_MAX = 64 << 20

__all__ = ["Server", "main"]


class Server:
    """The listening socket and the Caches; :meth:`run` serves until idle."""

    def __init__(self, directory: str, dir_fd: int, idle: float) -> None:
        self.directory = os.path.abspath(directory)
        #: The checked directory (:mod:`kernelcache._trust`): every file is made relative to it.
        self.dir_fd = dir_fd
        self.idle = idle
        self.caches: dict[Settings, Cache] = {}
        self.known = Identities()
        #: The flight claims held for clients compiling now (:mod:`kernelcache.nvcc.flight`).
        self.flying = Flying()
        #: (answer, whether to the compiled client) -> how many, for the log
        self.answered: dict[tuple[str, bool], int] = {}
        self.dir_id = _identity(os.fstat(dir_fd))
        self.path = os.path.join(self.directory, os.fsdecode(SOCKET))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET, dir_fd=dir_fd)  # a crashed server's; the lock says none is alive
        old = os.umask(0o177)  # mode 0600 from the start
        try:  # through the descriptor: the checked directory, and no sun_path length limit
            self.sock.bind(f"/proc/self/fd/{dir_fd}/{os.fsdecode(SOCKET)}")
        finally:
            os.umask(old)
        self.sock_id = _identity(os.stat(SOCKET, dir_fd=dir_fd, follow_symlinks=False))
        self.sock.listen(128)
        self.sock.settimeout(_TICK)

    def run(self) -> str:
        """Serve until a reason to exit, which it returns (for the log)."""
        last = time.monotonic()
        dirty = False
        while not _STOP.requested:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                self.flying.sweep()
                if dirty:
                    for cache in self.caches.values():
                        cache.flush_stats()
                    dirty = False
                if time.monotonic() - last > self.idle:
                    return "idle"
                if not self._still_bound():
                    return "its socket was removed or replaced"
                continue
            with conn:
                if not self.handle(conn):
                    return "a newer client"
            last, dirty = time.monotonic(), True
        return "SIGTERM"

    def _still_bound(self) -> bool:
        try:
            st = os.stat(SOCKET, dir_fd=self.dir_fd, follow_symlinks=False)
            return _identity(st) == self.sock_id
        except OSError:
            return False

    def handle(self, conn: socket.socket) -> bool:
        """Answer one client; ``False`` when this server should exit."""
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        if int.from_bytes(cred[4:8], sys.byteorder) != os.getuid():
            return True  # not this user's: no answer at all
        pid = int.from_bytes(cred[0:4], sys.byteorder)
        conn.settimeout(_REQUEST_TIMEOUT)
        try:
            request = receive(conn, _REQUEST_MAX)
        except (OSError, ValueError):
            return True
        if not request or len(request) < 5:
            return True
        # Asked while the client waits: once answered, it may be gone.
        compiled = is_compiled_client(pid)
        if request[0] == COMPILE and len(request) > 6:
            reply, stay = self.compile_step(request[1:], pid), True
        elif request[0] != PROTOCOL:
            # A newer client's server takes over (its client starts it once
            # this one is gone); an older or unknown one is answered and this
            # server stays: two versions sharing a directory never make
            # servers exit in turn.
            reply, stay = [b"fallback", b"protocol"], not _newer(request[0])
        else:
            reply, stay = self.answer(request[1:]), True
        # Counted before sending: a SIGTERM that arrives while sendall returns
        # (the client already has the reply) must not lose it from the log.
        key = (reply[0].decode(), compiled)
        self.answered[key] = self.answered.get(key, 0) + 1
        _send(conn, reply)
        return stay

    def report(self) -> str | None:
        """What it answered, for the log (each kind for each client), or ``None`` if nothing."""
        if not self.answered:
            return None
        kinds = ("hit", "plain", "fallback", "preprocess", "compile", "stored")
        parts = [
            " ".join(f"{k}={self.answered.get((k, native), 0)}" for k in kinds)
            for native in (False, True)
        ]
        return f"answered python client {parts[0]}; compiled client {parts[1]}"

    def answer(self, request: list[bytes]) -> list[bytes]:
        found = self._prepare(request)
        if isinstance(found, list):
            return found
        settings, job, cache = found
        try:
            hit = lookup(cache.get, job)
        except (OSError, ValueError, KernelCacheError):
            return [b"fallback", b"lookup"]  # the in-process run says or counts why
        return self._hit(settings, job, hit) or [b"fallback", b"miss"]

    def _prepare(self, request: list[bytes]) -> list[bytes] | tuple[Settings, Job, Cache]:
        """Settings, job and cache of a request, entered in its directory; else the reply."""
        cwd, directory, umask, count = request[:4]
        if not (count.isdigit() and umask.isdigit()):
            return [b"fallback", b"malformed"]
        argc = int(count)
        argv = [os.fsdecode(a) for a in request[4 : 4 + argc]]
        env = dict(_pair(item) for item in request[4 + argc :])
        try:
            os.chdir(cwd)
            os.umask(int(umask) & 0o777)  # the outputs get the modes nvcc would give them
            if _identity(os.stat(directory)) != self.dir_id or not argv:
                return [b"fallback", b"directory"]
            env["KERNELCACHE_DIR"] = self.directory
            settings = Settings.load(environ=env)
        except (OSError, KernelCacheError):
            return [b"fallback", b"settings"]
        nvcc = resolve_compiler(argv[0], env)
        if settings.disable:
            return [b"plain", os.fsencode(nvcc)]
        inv = parse(argv[1:], env)
        if inv.reason is not None:
            Outcome("uncacheable", reason=inv.reason).record(settings)
            return [b"plain", os.fsencode(nvcc)]
        try:
            return settings, Job.prepare(nvcc, inv, env, self.known), self._cache(settings)
        except (OSError, ValueError, KernelCacheError):
            return [b"fallback", b"lookup"]

    def _hit(
        self, settings: Settings, job: Job, hit: tuple[Entry, Entry] | None
    ) -> list[bytes] | None:
        if hit is None or not write_outputs(job.inv, hit[1], job.basedir):
            return None
        result = hit[1]
        Outcome("hits", saved=saved_seconds(result), detail="server_hits").record(settings)
        return [b"hit", b"0", *messages(result, job.basedir)]

    def compile_step(self, request: list[bytes], pid: int = 0) -> list[bytes]:
        """A miss the client ``pid`` compiles itself (:mod:`kernelcache.nvcc.compiling`): plan,
        lookup or store. A compile is planned under its flight claim, held here for the
        client until its store; if another compiles it now, the client gets ``fallback``
        and waits in the in-process launcher (:mod:`kernelcache.nvcc.flight`)."""
        from kernelcache.nvcc import compiling

        step, fields = request[0], compiling.STEPS.get(request[0])
        if fields is None or len(request) < 1 + fields + 4:
            return [b"fallback", b"malformed"]
        found = self._prepare(request[1 + fields :])
        if isinstance(found, list):
            return found
        settings, job, cache = found
        try:
            if step == b"plan":
                reply = self._hit(settings, job, lookup(cache.get, job)) or compiling.plan(
                    cache, job
                )
            elif step == b"lookup":
                reply = compiling.lookup(settings, cache, job, request[1 : 1 + fields])
            elif step == b"abandon":  # the client compiles in process: its claim is free
                self.flying.land(job.direct, pid)
                return [b"ok"]
            else:
                try:
                    return compiling.store(settings, cache, job, request[1 : 1 + fields])
                finally:
                    self.flying.land(job.direct, pid)
        except (OSError, ValueError, KernelCacheError):
            return [b"fallback", b"lookup"]
        if reply[0] == b"compile" and not self.flying.take(cache, job.direct, pid):
            return [b"fallback", b"flight"]
        return reply

    def _cache(self, settings: Settings) -> Cache:
        cache = self.caches.get(settings)
        if cache is None:
            if len(self.caches) >= MAX_CACHES:
                self.flying.close()  # their locks belong to the caches closed here
                self.close_caches()
            tiers = [t for t in default_tiers(settings) if t.kind != "memory"]
            cache = self.caches[settings] = Cache(tiers, settings=settings)
        return cache

    def close_caches(self) -> None:
        for cache in self.caches.values():
            cache.close()
        self.caches.clear()

    def close(self) -> None:
        report = self.report()
        if report is not None:
            print(f"kernelcache server: {report}", file=sys.stderr, flush=True)
        self.flying.close()
        self.close_caches()
        if self._still_bound():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SOCKET, dir_fd=self.dir_fd)
        self.sock.close()


class _Stop:
    """SIGTERM's request to exit (:meth:`on_sigterm`), which :meth:`Server.run` also reads.

    The SystemExit the handler raises ends whatever the server is doing, but
    alone it is not enough: Python runs a handler between any two bytecodes of
    the main thread, and the exception can be lost there: printed and dropped
    in a finalizer (``__del__``, ``weakref.finalize``), or replaced by an error
    the code around it handles (the trust walk once closed a descriptor twice
    on its way out: EBADF, taken for a miss). A server that lost it served on
    until idle, and a test's stop gave up after 60 s (issue 40). The flag
    makes it exit at its next tick anyway.
    """

    def __init__(self) -> None:
        self.requested = False

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.requested = True
        sys.exit(0)


#: This process's (the handler is installed by :func:`main`).
_STOP = _Stop()


def _newer(protocol: bytes) -> bool:
    """Whether ``protocol`` is a later version of :data:`PROTOCOL`."""
    name, _, version = PROTOCOL.rpartition(b"/")
    other_name, _, other = protocol.rpartition(b"/")
    return other_name == name and other.isdigit() and int(other) > int(version)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _pair(item: bytes) -> tuple[str, str]:
    name, _, value = item.partition(b"=")
    return os.fsdecode(name), os.fsdecode(value)


def _send(conn: socket.socket, items: list[bytes]) -> None:
    with contextlib.suppress(OSError):  # the client gave up: it compiles by itself
        conn.sendall(pack(items))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kernelcache.nvcc.server CACHE_DIR", file=sys.stderr)
        return 2
    directory = os.path.abspath(argv[0])
    # Hold none of the starting client's descriptors (a build tool's pipes).
    os.closerange(3, min(os.sysconf("SC_OPEN_MAX"), 65536))
    with contextlib.suppress(OSError):
        os.setsid()  # no terminal's Ctrl-C; started through sh, so never a group leader
    signal.signal(signal.SIGTERM, _STOP.on_sigterm)
    try:
        # Stricter than the disk tier: this user's own, not even root's, since
        # a program runs from here. Nothing is written before this check.
        dir_fd = _trust.open_dir(directory, allow_root=False)
        if dir_fd is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
        log = _trust.open_file(dir_fd, LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        lock = _trust.open_file(dir_fd, LOCK, os.O_RDWR | os.O_CREAT)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(lock, 0)
        idle = idle_seconds(os.environ)
        os.write(lock, b"%d %r\n" % (os.getpid(), idle))  # for control.stop() and running()
    except _trust.UntrustedDirectory as exc:
        print(f"kernelcache server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return 0  # another server holds the directory
        print(f"kernelcache server: {exc}", file=sys.stderr)
        return 1
    server = Server(directory, dir_fd, idle)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(STARTING, dir_fd=dir_fd)
    build = None
    why = "an error"
    try:
        build = start_build(server.directory, os.environ)
        why = server.run()
    finally:
        if _STOP.requested:
            why = "SIGTERM"
        print(f"kernelcache server: exiting: {why}", file=sys.stderr, flush=True)
        server.close()
        if build is not None:
            build.join()  # each of its steps is bounded (native.STEP_TIMEOUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
