"""Shared fixtures: real Redis servers and clusters, and no launcher server left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from redis_cluster import own_cluster, redis_cluster  # noqa: F401 (fixtures for every test file)
from redis_proxy import proxy  # noqa: F401
from redis_server import own_redis, redis_server  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _launcher_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No launcher server outlives the test run (kernelcache.nvcc.server).

    Servers started by tests (every launcher call through the client starts
    one for its cache directory) exit after 5 idle seconds, and any still
    running under this session's temporary directory is stopped at the end.
    """
    from kernelcache.nvcc import server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_SERVER_IDLE", os.environ.get("KERNELCACHE_SERVER_IDLE", "5"))
        yield
    for lock in tmp_path_factory.getbasetemp().rglob(server.LOCK):
        server.stop(str(lock.parent))
