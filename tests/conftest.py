"""Shared fixtures: real Redis servers and clusters, and no launcher server left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import netfs
from object_servers import http_url, nginx_server, radosgw, s3_env, s3_url  # noqa: F401
from redis_cluster import own_cluster, redis_cluster  # noqa: F401 (fixtures for every test file)
from redis_proxy import proxy  # noqa: F401
from redis_server import ns, own_redis, raw, redis_server  # noqa: F401

#: The suite's own home directory (pytest_configure): the user's stays untouched.
_HOME: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """HOME and XDG_CACHE_HOME point at a temporary directory for the whole run, set in
    os.environ before any test is collected, so every subprocess inherits them: the
    suite never writes into the user's ~/.cache/kernelcache (issue 20: the toolchain
    probes' and TileLang's memos landed there)."""
    if _HOME:
        return
    home = tempfile.mkdtemp(prefix="kernelcache-test-home-")
    _HOME["home"] = home
    os.environ["HOME"] = home
    os.environ["XDG_CACHE_HOME"] = os.path.join(home, ".cache")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _HOME:
        shutil.rmtree(_HOME["home"], ignore_errors=True)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Callable[..., netfs.NetFS]]:
    """Mount two "nodes" of a fault-injecting network filesystem (tests/netfs.py).

    ``two_nodes(flock="local", faults=Faults())``; everything mounted is
    unmounted, and its daemons stopped, when the test ends. Skips only where
    FUSE cannot work here (no /dev/fuse, no permission to mount, no compiler
    or libfuse3 headers; scripts/test.sh installs the last two).
    """
    reason = netfs.unavailable()
    if reason:
        pytest.skip(reason)
    mounted: list[netfs.NetFS] = []

    def mount(flock: str = "local", faults: netfs.Faults = netfs.NO_FAULTS) -> netfs.NetFS:
        root = tmp_path / f"netfs{len(mounted)}"
        root.mkdir()
        try:
            fs = netfs.NetFS(root, flock, faults)
        except netfs.MountRefused as exc:
            pytest.skip(netfs.SKIP_REASON.format(f"mount refused: {exc}"))
        mounted.append(fs)
        return fs

    try:
        yield mount
    finally:
        for fs in mounted:
            fs.close()


@pytest.fixture(scope="session", autouse=True)
def _launcher_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No launcher server outlives the test run (kernelcache.nvcc.server).

    Servers started by tests (every launcher call through the client starts
    one for its cache directory) exit after 5 idle seconds, and any still
    running under this session's temporary directory is stopped at the end.
    They do not build the compiled client (~0.3 s of cc each, and a test of
    the Python client must not find itself served by the C one half-way):
    tests/test_launcher_compiled.py turns that on where it tests it.
    """
    from kernelcache.nvcc import control, native
    from launcher_env import stop_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_SERVER_IDLE", os.environ.get("KERNELCACHE_SERVER_IDLE", "5"))
        mp.setenv(native.ENV, os.environ.get(native.ENV, "0"))
        yield
    for lock in tmp_path_factory.getbasetemp().rglob(control.LOCK):
        stop_server(lock.parent)
