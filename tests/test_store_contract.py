"""The store contract (:mod:`kernelcache.testing`) run over every built-in tier.

Each class says how to make its tier and what the tier documents it lacks
(persistence for the memory tier, size caps for Redis, whose maxmemory policy
evicts instead); the tests themselves live in :class:`StoreContract`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache.stores.base import Store
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.disk import store as disk_module
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.redis import RedisStore
from kernelcache.stores.sqlite import SQLiteStore
from kernelcache.stores.sqlite import store as sqlite_module
from kernelcache.testing import StoreContract, StoreFactory


def closing(make: StoreFactory) -> Iterator[StoreFactory]:
    """``make`` wrapped so that every store it made is closed at the end of the test."""
    made: list[Store] = []

    def factory(**options: object) -> Store:
        made.append(make(**options))
        return made[-1]

    yield factory
    for store in made:
        store.close()


class TestMemory(StoreContract):
    persistent = False

    @pytest.fixture
    def store_factory(self) -> Iterator[StoreFactory]:
        yield from closing(MemoryStore)


class TestDisk(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[StoreFactory]:
        yield from closing(lambda **options: DiskStore(tmp_path / "disk", **options))

    @pytest.fixture
    def touch_every_hit(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(disk_module, "TOUCH_INTERVAL", 0.0)


class TestSQLite(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[StoreFactory]:
        yield from closing(lambda **options: SQLiteStore(tmp_path / "cache.sqlite", **options))

    @pytest.fixture
    def touch_every_hit(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(sqlite_module, "TOUCH_INTERVAL", 0.0)


def redis_factory(url: str, tmp_path: Path) -> Iterator[StoreFactory]:
    # One namespace per test, like one directory per test for the disk tier: two
    # stores made by the same test share their entries. The contract is not about
    # time: a loaded CI machine may stall a call past the default 0.5 s (tests of
    # the timeout set their own).
    namespace = "t" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16]
    yield from closing(
        lambda read_only=False: RedisStore(
            url, namespace=namespace, read_only=read_only, timeout=5.0
        )
    )


class TestRedis(StoreContract):
    capped = False

    @pytest.fixture
    def store_factory(self, redis_server: object, tmp_path: Path) -> Iterator[StoreFactory]:
        yield from redis_factory(redis_server.url, tmp_path)  # type: ignore[attr-defined]


class TestRedisCluster(StoreContract):
    capped = False

    @pytest.fixture
    def store_factory(self, redis_cluster: object, tmp_path: Path) -> Iterator[StoreFactory]:
        yield from redis_factory(redis_cluster.url, tmp_path)  # type: ignore[attr-defined]


class TestS3(StoreContract):
    capped = False  # capped by prune --remote and bucket lifecycle rules, not by puts

    @pytest.fixture
    def store_factory(self, s3_url: str) -> Iterator[StoreFactory]:
        from kernelcache.stores import S3Store

        yield from closing(lambda read_only=False: S3Store(s3_url, read_only=read_only, timeout=30))


class TestHTTP(StoreContract):
    capped = False

    @pytest.fixture
    def store_factory(self, http_url: str) -> Iterator[StoreFactory]:
        from kernelcache.stores import HTTPStore

        yield from closing(
            lambda read_only=False: HTTPStore(http_url, read_only=read_only, timeout=30)
        )
