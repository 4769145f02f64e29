"""Helpers for tests of the ``kernelcache`` executable and its server, as a user runs them.

``make_bin`` lays out what pip installs: ``kernelcache`` (this checkout's
``bin/kernelcache``) next to a ``kernelcache-cli`` console script whose first
line names this interpreter, so the tests run the shell front, the client
without site and the server exactly as installed, on this checkout's code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = f"""#!{sys.executable}
import sys
from kernelcache.__main__ import main
sys.exit(main())
"""


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


def start_server(cache_dir: Path, env: dict[str, str], timeout: float = 60.0) -> None:
    """Start the server for ``cache_dir`` as a client does, with ``env``; wait until it listens."""
    from kernelcache.nvcc import client

    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        client.start_server(os.fsencode(cache_dir))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    wait_for(lambda: (cache_dir / "launcher.sock").exists(), timeout, "the server to listen")


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.02)


def server_pid(cache_dir: Path) -> int | None:
    """The pid of the server holding ``cache_dir``'s lock, or ``None``."""
    import fcntl

    try:
        fd = os.open(cache_dir / "launcher.lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return int(os.pread(fd, 32, 0).split()[0])
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stats(cache_dir: Path) -> dict[str, int]:
    path = cache_dir / "nvcc-stats.json"
    data = json.loads(path.read_bytes() or b"{}") if path.exists() else {}
    fields = ("hits", "misses", "uncacheable", "failed", "server_hits", "preprocessed_hits")
    return {k: int(data.get(k, 0)) for k in fields}


def reasons(cache_dir: Path) -> dict[str, int]:
    path = cache_dir / "nvcc-stats.json"
    return dict(json.loads(path.read_bytes()).get("reasons", {})) if path.exists() else {}
