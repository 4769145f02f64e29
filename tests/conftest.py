"""Shared fixtures. ``store_factory`` parametrizes the contract suite over every tier."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelcache.stores.base import Store
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.sqlite import SQLiteStore
from redis_cluster import own_cluster, redis_cluster  # noqa: F401 (fixtures for every test file)
from redis_proxy import proxy  # noqa: F401
from redis_server import own_redis, redis_server  # noqa: F401

StoreFactory = Callable[..., Store]


def _memory(tmp_path: Path, request: pytest.FixtureRequest, **caps: int | None) -> Store:
    return MemoryStore(
        max_entries=caps.get("max_entries"),
        max_bytes=caps.get("max_bytes"),
        read_only=bool(caps.get("read_only")),
    )


def _disk(tmp_path: Path, request: pytest.FixtureRequest, **caps: int | None) -> Store:
    return DiskStore(
        tmp_path / "disk",
        max_bytes=caps.get("max_bytes"),
        max_entries=caps.get("max_entries"),
        read_only=bool(caps.get("read_only")),
    )


def _sqlite(tmp_path: Path, request: pytest.FixtureRequest, **caps: int | None) -> Store:
    return SQLiteStore(
        tmp_path / "cache.sqlite",
        max_bytes=caps.get("max_bytes"),
        max_entries=caps.get("max_entries"),
        read_only=bool(caps.get("read_only")),
    )


def _redis(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    fixture: str = "redis_server",
    **caps: int | None,
) -> Store:
    from kernelcache.stores.redis import RedisStore

    if caps.get("max_bytes") is not None or caps.get("max_entries") is not None:
        pytest.skip("the redis tier has no per-store size caps (Redis's maxmemory policy evicts)")
    server = request.getfixturevalue(fixture)  # skips when redis-server is missing
    # One namespace per test, like one directory per test for the disk tier:
    # two stores made by the same test share their entries.
    return RedisStore(
        server.url,
        namespace="t" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16],
        read_only=bool(caps.get("read_only")),
        # The contract is not about time: a loaded CI machine may stall a call
        # past the default 0.5 s (tests of the timeout set their own).
        timeout=5.0,
    )


def _redis_cluster(tmp_path: Path, request: pytest.FixtureRequest, **caps: int | None) -> Store:
    return _redis(tmp_path, request, "redis_cluster", **caps)


#: Every tier the contract suite runs over: name -> factory(tmp_path, request, **caps).
STORE_FACTORIES: dict[str, Callable[..., Store]] = {
    "memory": _memory,
    "disk": _disk,
    "sqlite": _sqlite,
    "redis": _redis,
    "redis-cluster": _redis_cluster,
}


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """A function making fresh stores of one kind; every store it made is closed afterwards."""
    made: list[Store] = []

    def make(**caps: int | None) -> Store:
        store = STORE_FACTORIES[request.param](tmp_path, request, **caps)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(store_factory: StoreFactory) -> Store:
    return store_factory()


@pytest.fixture(scope="session", autouse=True)
def _launcher_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No launcher server outlives the test run (kernelcache.nvcc.server).

    Servers started by tests (every launcher call through the client starts
    one for its cache directory) exit after 5 idle seconds, and any still
    running under this session's temporary directory is stopped at the end.
    """
    import os

    from kernelcache.nvcc import server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_SERVER_IDLE", os.environ.get("KERNELCACHE_SERVER_IDLE", "5"))
        yield
    for lock in tmp_path_factory.getbasetemp().rglob(server.LOCK):
        server.stop(str(lock.parent))
