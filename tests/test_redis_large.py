"""Large entries go through chunks; a reader racing the writer never sees part of one."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from typing import Any

import pytest
import xxhash

from kernelcache import Entry
from kernelcache.stores.redis import RedisStore
from redis_server import LOADED, RedisServer, unique_namespace

SPAWN = multiprocessing.get_context("spawn")
MB = 1 << 20


def _version(v: int, size: int) -> Entry:
    # Random bytes, the incompressible worst case. The digest in the metadata is
    # computed here, independently of the store, so the reader can check that
    # what it got is exactly the version that was written, whole.
    blob = os.urandom(size)
    return Entry({"blob": blob}, meta={"v": v, "xxh": xxhash.xxh3_128_hexdigest(blob)})


def _check(entry: Entry | None, size: int) -> int:
    assert entry is not None  # there is always a whole entry to see
    blob = entry["blob"]
    assert len(blob) == size
    assert xxhash.xxh3_128_hexdigest(blob) == entry.meta["xxh"]
    return int(entry.meta["v"])


def _writer(url: str, ns: str, versions: list[int], size: int, chunk: int, started: Any) -> None:
    store = RedisStore(url, namespace=ns, chunk_size=chunk, timeout=LOADED)
    started.set()
    for v in versions:
        store.put("k", _version(v, size))


def _race(url: str, versions: list[int], size: int, chunk: int) -> list[int]:
    """Read ``k`` while another process rewrites it; returns the versions seen in order."""
    ns = unique_namespace()
    reader = RedisStore(url, namespace=ns, chunk_size=chunk, timeout=LOADED)
    reader.put("k", _version(0, size))
    started = SPAWN.Event()
    writer = SPAWN.Process(target=_writer, args=(url, ns, versions, size, chunk, started))
    writer.start()
    seen: list[int] = []
    try:
        assert started.wait(timeout=60)
        while writer.is_alive():
            seen.append(_check(reader.get("k"), size))
    finally:
        writer.join(timeout=120)
    assert writer.exitcode == 0
    assert _check(reader.get("k"), size) == versions[-1]
    assert seen == sorted(seen)  # versions only move forward
    assert reader.counters.corrupt == 0
    assert reader.counters.errors == 0
    return seen


@pytest.mark.slow
def test_a_200_mb_entry_round_trips_and_racing_readers_see_it_whole(
    redis_server: RedisServer,
) -> None:
    seen = _race(redis_server.url, [1, 2], 200 * MB, 4 << 20)
    assert len(seen) >= 2


@pytest.mark.slow
def test_many_small_chunked_rewrites_never_show_a_mix(redis_server: RedisServer) -> None:
    start = time.monotonic()
    seen = _race(redis_server.url, list(range(1, 301)), 5 * 64 * 1024, 64 * 1024)
    assert len(set(seen)) > 10  # the reads really interleaved with the writes
    assert time.monotonic() - start < 60


def test_a_compressed_entry_round_trips_through_chunks(redis_server: RedisServer) -> None:
    store = RedisStore(
        redis_server.url, namespace=unique_namespace(), chunk_size=MB, timeout=LOADED
    )
    entry = Entry({"a": random.randbytes(12 * MB), "b": bytes(12 * MB)})  # half random, half zeros
    store.put("k", entry)
    [info] = store.scan()
    assert info.extra["compressed"]
    assert info.extra["chunks"] > 1
    assert store.get("k") == entry
