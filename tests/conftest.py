"""Shared fixtures: real Redis servers and clusters, and no launcher server left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

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
    from kernelcache.nvcc import native, server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_SERVER_IDLE", os.environ.get("KERNELCACHE_SERVER_IDLE", "5"))
        mp.setenv(native.ENV, os.environ.get(native.ENV, "0"))
        yield
    for lock in tmp_path_factory.getbasetemp().rglob(server.LOCK):
        server.stop(str(lock.parent))
