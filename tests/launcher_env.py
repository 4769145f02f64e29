"""Helpers for tests of the ``kernelcache`` executable and its server, as a user runs them.

``make_bin`` lays out what pip installs: ``kernelcache`` (this checkout's
``bin/kernelcache``) next to a ``kernelcache-cli`` console script whose first
line names this interpreter, so the tests run the shell front, the client
without site and the server exactly as installed, on this checkout's code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = f"""#!{sys.executable}
import sys
from kernelcache.__main__ import main
sys.exit(main())
"""


def without_file_symbol(data: bytes) -> bytes:
    """An nvcc object less the file symbol naming its temporary host source.

    Plain nvcc names it ``tmpxft_<pid>_..._k.cudafe1.cpp`` (so two plain runs
    already differ there); a cold miss compiles with ``--keep`` into a
    temporary directory (its preprocessed key comes from the kept files), where
    it is ``k.cudafe1.cpp``. Everything else is compared byte for byte; data
    without such a symbol (cubins, dependency files) is returned as it is.
    """
    import tempfile

    if not data.startswith(b"\x7fELF") or b".cudafe1.cpp" not in data:
        return data
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "object.o"
        path.write_bytes(data)
        subprocess.run(["objcopy", "-w", "--strip-symbol=*.cudafe1.cpp", str(path)], check=True)
        return path.read_bytes()


def make_bin(where: Path) -> Path:
    """A directory holding ``kernelcache`` and ``kernelcache-cli``; returns ``kernelcache``."""
    where.mkdir(parents=True, exist_ok=True)
    front = where / "kernelcache"
    front.symlink_to(ROOT / "bin" / "kernelcache")
    cli = where / "kernelcache-cli"
    cli.write_text(CONSOLE_SCRIPT)
    cli.chmod(0o755)
    return front


def clean_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a user of ``cache_dir``; the test stops the server it starts.

    The server waits 60 idle seconds (not the suite's default 5): a compile
    between two calls can take longer on a loaded machine, and a test that
    expects a server hit must not see it gone.
    """
    env = {**os.environ, "KERNELCACHE_DIR": str(cache_dir), "KERNELCACHE_SERVER_IDLE": "60"}
    # The compiled client is built in the cache directory itself, not in this user's
    # shared folder: each test sees its own builds (native.shared_dir).
    env["KERNELCACHE_CLIENT_DIR"] = str(cache_dir)
    env.update(extra)
    for name in (
        "KERNELCACHE_BASEDIR",
        "KERNELCACHE_REMOTE",
        "KERNELCACHE_DISABLE",
        "KERNELCACHE_SERVER",
        "KERNELCACHE_HASH_DIR",
        "KERNELCACHE_SLOPPINESS",
        "NVCC_APPEND_FLAGS",
        "NVCC_PREPEND_FLAGS",
        "NVCC_CCBIN",
    ):
        if name not in extra:
            env.pop(name, None)
    return env


#: One kernel (its unused variable: a warning on stderr that every hit must replay).
KERNEL = """__global__ void saxpy(float a, const float* x, float* y) {
    int unused_on_purpose;  // a warning on stderr, replayed by every hit
    y[threadIdx.x] = a * x[threadIdx.x] + y[threadIdx.x];
}
"""
CUBIN = ["-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]


class Project:
    """A user's bin directory, cache directory and project (``k.cu``), under ``root``."""

    def __init__(self, root: Path) -> None:
        self.front = make_bin(root / "bin")
        self.cache = root / "cache"
        self.project = root / "project"
        self.project.mkdir()
        (self.project / "k.cu").write_text(KERNEL)
        self.env = clean_env(self.cache)

    def run(self, args: list[str] = CUBIN, **env: str) -> subprocess.CompletedProcess[bytes]:
        """``kernelcache nvcc ARGS`` in the project, as the user runs it."""
        return subprocess.run(
            [str(self.front), "nvcc", *args],
            cwd=self.project,
            env={**self.env, **env},
            capture_output=True,
            check=False,
        )

    def warm(self) -> subprocess.CompletedProcess[bytes]:
        """A miss, then the server started: the next call is a server hit."""
        miss = self.run()
        assert miss.returncode == 0, miss.stderr
        assert stats(self.cache)["misses"] == 1, miss.stderr
        start_server(self.cache, self.env)
        return miss


def start_server(cache_dir: Path, env: dict[str, str], timeout: float = 60.0) -> None:
    """Start the server for ``cache_dir`` as the launcher does, with ``env``; wait until it listens."""
    from kernelcache.nvcc import spawn

    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if listening(cache_dir):
        # Already started (by a miss through the Python client). Another start
        # would spawn a server that exits at once, unless it is slow enough to
        # take the lock from the first as a test stops it: stop() then waits
        # for the wrong server.
        return
    spawn.start(str(cache_dir), env)
    wait_for(lambda: listening(cache_dir), timeout, "the server to listen")


#: How long a test waits for a stopped server to exit. It exits at once, but on
#: a loaded CI machine (two workers compiling, coverage saving each process's
#: data on its way out) one was seen still running after stop()'s own 10 s.
STOP_TIMEOUT = 60.0


def stop_server(cache_dir: Path | str) -> bool:
    """Stop ``cache_dir``'s server and wait for it to exit; ``False`` if none ran."""
    from kernelcache.nvcc import control

    try:
        return control.stop(str(cache_dir), STOP_TIMEOUT)
    except TimeoutError as exc:
        # Seen once in CI (a server resumed after SIGSTOP, then sent SIGTERM, still in
        # poll() 60 s later) and never again: the server's own log says what it was doing.
        log = Path(cache_dir) / control.LOG
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        raise TimeoutError(f"{exc}\nits log ends:\n{tail}") from exc


def listening(cache_dir: Path) -> bool:
    """Whether a server accepts connections on ``cache_dir``'s socket.

    The socket file existing is not enough: a killed server leaves its file
    behind until the next server replaces it. An empty connection is
    answered with nothing and counts nothing.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(cache_dir / "launcher.sock"))
        except OSError:
            return False
    return True


def starting_or_running(cache_dir: Path) -> bool:
    """Whether a server process for ``cache_dir`` exists, from the ``sh`` that starts it
    (``kernelcache.nvcc.spawn``) to its exit: both name the module and the directory."""
    wanted = (b"kernelcache.nvcc.server", os.fsencode(cache_dir))
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if any(wanted[0] in word for word in words) and wanted[1] in words:
            return True
    return False


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.02)


def server_pid(cache_dir: Path) -> int | None:
    """The pid of the server holding ``cache_dir``'s lock (0 while it writes it), or ``None``."""
    from kernelcache.nvcc import control

    found = control.running(str(cache_dir))
    return None if found is None else found[0]


def stats(cache_dir: Path) -> dict[str, int]:
    path = cache_dir / "nvcc-stats.json"
    data = json.loads(path.read_bytes() or b"{}") if path.exists() else {}
    fields = ("hits", "misses", "uncacheable", "failed", "server_hits", "preprocessed_hits")
    return {k: int(data.get(k, 0)) for k in fields}


def reasons(cache_dir: Path) -> dict[str, int]:
    path = cache_dir / "nvcc-stats.json"
    return dict(json.loads(path.read_bytes()).get("reasons", {})) if path.exists() else {}


class FakeServer:
    """A listener on the launcher's socket that reads each request and sends ``reply`` (raw bytes).

    It answers ``count`` connections, keeps each request, and notes whether
    the peer was a compiled client (asked while it waits, as the server does).
    """

    def __init__(self, path: Path, reply: bytes, count: int = 1) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        old = os.umask(0o177)
        try:  # through the directory: the path may be too long for sun_path
            self.sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
        finally:
            os.umask(old)
            os.close(dir_fd)
        self.sock.listen(4)
        self.reply, self.count = reply, count
        self.requests: list[list[bytes] | None] = []
        self.compiled: list[bool] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        from kernelcache.nvcc import client, native

        for _ in range(self.count):
            conn, _ = self.sock.accept()
            with conn:
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                self.compiled.append(native.is_compiled_client(int.from_bytes(cred[:4], "little")))
                self.requests.append(client.receive(conn))
                conn.sendall(self.reply)

    def close(self) -> None:
        self.thread.join(timeout=60)
        self.sock.close()


def client_path(cache_dir: Path) -> Path:
    """Where ``kernelcache`` looks for the compiled client of this checkout, on this machine."""
    from kernelcache.nvcc import native

    tag = native.platform_tag()
    assert tag is not None, "this host's name cannot be part of a file name"
    return cache_dir / native.binary_name(Path(native.SOURCE).read_bytes(), tag)


def mark(path: Path, boot: str | None = None) -> Path:
    """Say that ``path`` (a client) ran on this machine since ``boot`` (default: this boot)."""
    from kernelcache.nvcc import native

    boot = boot or native.boot_id()
    assert boot is not None
    link = path.with_name(native.mark_name(path.name, boot))
    link.unlink(missing_ok=True)
    os.link(path, link)
    return link


def install_client(cache_dir: Path, binary: Path) -> Path:
    """Put ``binary`` where ``kernelcache`` looks for the compiled client, as the server would:
    this user's, mode 1700 (the sticky bit marks a client the server built), marked for this boot."""
    from kernelcache.nvcc import native

    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = client_path(cache_dir)
    target.unlink(missing_ok=True)
    shutil.copyfile(binary, target)
    target.chmod(native.MODE)
    mark(target)
    return target


def answered(cache_dir: Path) -> dict[str, int]:
    """What the servers of ``cache_dir`` that have exited answered, from the log.

    Keys ``"python hit"``, ``"compiled fallback"``, ...: the answer and who asked.
    """
    found: dict[str, int] = {}
    path = cache_dir / "launcher.log"
    text = path.read_text() if path.exists() else ""
    pattern = r"answered python client (.*); compiled client (.*)"
    for line in re.findall(pattern, text):
        for who, counts in zip(("python", "compiled"), line, strict=True):
            for name, n in re.findall(r"(\w+)=(\d+)", counts):
                found[f"{who} {name}"] = found.get(f"{who} {name}", 0) + int(n)
    return found
