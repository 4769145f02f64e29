"""Shared fixtures. ``store_factory`` parametrizes the contract suite over every tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelcache.stores.base import Store
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.sqlite import SQLiteStore

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


#: Every tier the contract suite runs over: name -> factory(tmp_path, request, **caps).
#: ``caps``: max_bytes, max_entries, read_only. Persistent tiers reopen the same
#: place when called again within one test.
STORE_FACTORIES: dict[str, Callable[..., Store]] = {
    "memory": _memory,
    "disk": _disk,
    "sqlite": _sqlite,
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
