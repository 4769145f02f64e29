"""A slow, garbage-speaking or hostile Redis costs at most the timeout, and no memory or CPU.

The server is always a real redis-server; slowness and garbage come from a
misbehaving proxy in front of it (redis_proxy.py), oversized values are
written by the server itself (SETRANGE) so the test never holds them.
"""

from __future__ import annotations

import os
import time
import types
from typing import Any

import pytest
import redis

from kernelcache import Cache, Entry
from kernelcache.errors import StoreError
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.redis import RedisStore, badvalues, breaker
from kernelcache.stores.redis import format as fmt
from kernelcache.stores.redis.badvalues import BadValues
from redis_proxy import MisbehavingProxy
from redis_server import LOADED, RedisServer

CHUNK = fmt.MIN_CHUNK_SIZE


def _name(ns: str, key: str) -> str:
    return f"kc:{ns}:e:{{{key}}}"


def _calls(raw: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = raw.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _misses(raw: redis.Redis) -> int:
    """Lookups of keys that do not exist (a chunk fetched that is not there)."""
    return int(raw.info("stats")["keyspace_misses"])


# A slow server -------------------------------------------------------------------------
def test_a_trickling_server_costs_one_deadline_per_call_then_the_breaker_skips_it(
    redis_server: RedisServer, proxy: MisbehavingProxy, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The breaker's clock moves by hand: with a real 0.5 s cooldown, a loaded machine
    # that stalled this thread that long after the trip let the skipped call through
    # as a probe (a second trip, no skip). The calls' deadlines stay real.
    now = [1000.0]
    monkeypatch.setattr(breaker, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    timeout = 0.3
    RedisStore(redis_server.url, namespace=ns, timeout=LOADED).put(
        "k", Entry({"a": os.urandom(4096)})
    )
    with RedisStore(proxy.url, namespace=ns, timeout=LOADED) as passing:
        assert passing.get("k") is not None  # the proxy passes replies for now
    remote = RedisStore(
        proxy.url, namespace=ns, timeout=timeout, breaker_threshold=3, breaker_cooldown=0.5
    )
    cache = Cache([MemoryStore(), remote])
    proxy.mode = "trickle"  # 4 bytes every 100 ms: the whole reply would take ~100 s
    costs = []
    for _ in range(3):
        start = time.perf_counter()
        assert cache.get("k") is None
        costs.append(time.perf_counter() - start)
    # Each read of the trickle returns within 100 ms, so a per-read timeout never
    # fires; the call's deadline does. (Before: 7.3 s per get, breaker never open.)
    assert max(costs) < 20 * timeout
    assert remote.counters.timeouts == 3
    assert remote.counters.breaker_trips == 1
    assert cache.get("k") is None
    assert remote.counters.skipped == 1
    proxy.mode = "pass"
    deadline = time.monotonic() + 30
    while True:
        now[0] += 1  # past the cooldown: the next call is the breaker's probe
        got = cache.get("k")
        if remote.breaker.state == "closed":
            break
        assert time.monotonic() < deadline, "the probes never closed the breaker"
    assert got is not None  # recovered: the probe read the entry through the proxy


def test_a_server_answering_garbage_is_a_miss_and_opens_the_breaker(
    proxy: MisbehavingProxy, ns: str
) -> None:
    remote = RedisStore(proxy.url, namespace=ns, timeout=0.3, breaker_threshold=3)
    cache = Cache([MemoryStore(), remote])
    proxy.mode = "garbage"
    for _ in range(3):
        assert cache.get("k") is None
    assert remote.counters.errors == 3
    assert remote.breaker.state == "open"
    cache.put("k", Entry({"a": b"x"}))  # skipped by the breaker, kept by the memory tier
    assert remote.stats()["skipped"] == 1
    assert cache.get("k") is not None
    with pytest.raises(StoreError):
        remote.get("k")  # used directly, the store says what failed


# Oversized values ------------------------------------------------------------------------
@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_256_mib_value_at_an_entry_key_is_refused_unread(
    redis_server: RedisServer, raw: redis.Redis, ns: str, read_only: bool
) -> None:
    name = _name(ns, "k")
    raw.setrange(name, (256 << 20) - 1, b"x")  # made by the server: this test never holds it
    store = RedisStore(redis_server.url, namespace=ns, timeout=LOADED, read_only=read_only)
    sent = raw.info("stats")["total_net_output_bytes"]
    assert store.get("k") is None
    assert raw.info("stats")["total_net_output_bytes"] - sent < 64 << 20  # not 256 MiB
    assert store.counters.oversized == 1
    assert store.counters.errors == 0
    assert store.breaker.state == "closed"  # the server answered: it is not down
    assert raw.exists(name) == (1 if read_only else 0)  # dropped unread where writable
    gets = _calls(raw, "get")
    assert store.get("k") is None  # the next lookup does not pay again:
    assert _calls(raw, "get") == gets + (0 if read_only else 1)  # remembered, or a plain miss
    assert store.counters.oversized == 1
    raw.delete(name)


def _rle_bomb(size: int) -> bytes:
    """A zstd frame declaring ``size`` bytes of zeros in 4-byte RLE blocks of 128 KiB each."""
    block = 128 << 10
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([0xE0]) + size.to_bytes(8, "little")
    blocks = [((block << 3) | (1 << 1)).to_bytes(3, "little") + b"\0"] * (size // block)
    last = bytearray(blocks[-1])
    last[0] |= 1  # Last_Block
    return header + b"".join(blocks[:-1]) + bytes(last)


@pytest.mark.parametrize(
    ("max_entry_size", "kept"),
    [
        pytest.param(2 << 30, False, id="over-the-ratio-deleted"),
        pytest.param(None, True, id="over-max_entry_size-remembered"),
    ],
)
def test_a_zstd_bomb_is_refused_before_inflating(
    redis_server: RedisServer,
    raw: redis.Redis,
    ns: str,
    monkeypatch: pytest.MonkeyPatch,
    max_entry_size: int | None,
    kept: bool,
) -> None:
    import zstandard

    frame = _rle_bomb(1 << 30)
    assert len(frame) < 40 << 10
    assert zstandard.frame_content_size(frame) == 1 << 30
    name = _name(ns, "k")
    raw.set(name, fmt.seal(name.encode(), fmt.ZSTD, 1 << 30, frame, None))
    inflated: list[int] = []
    real = fmt.decompress

    def spy(frame: Any, size: int) -> bytes:
        inflated.append(size)
        return real(frame, size)

    monkeypatch.setattr(fmt, "decompress", spy)
    store = RedisStore(
        redis_server.url, namespace=ns, timeout=LOADED, max_entry_size=max_entry_size
    )
    assert store.get("k") is None
    assert store.get("k") is None
    assert inflated == []  # refused before the work (before: +971 MiB and ~2 s per read)
    assert store.counters.oversized == 1
    assert store.counters.corrupt == 0
    assert raw.exists(name) == int(kept)  # a peer allowing more keeps its entry


def _manifest_record(ns: str, key: str, chunks: int, stored: int) -> tuple[str, bytes]:
    name = _name(ns, key)
    manifest = fmt.Manifest("ab" * 16, chunks, CHUNK, stored, "cd" * 16)
    return name, fmt.seal(name.encode(), fmt.CHUNKED, stored, manifest.encode(), None)


@pytest.mark.parametrize(
    ("stored", "counter", "kept"),
    [
        pytest.param(100_000 * CHUNK, "oversized", True, id="over-max_entry_size"),
        pytest.param(1 << 20, "corrupt", False, id="count-disagrees-with-sizes"),
    ],
)
def test_a_manifest_claiming_100000_chunks_fetches_none(
    redis_server: RedisServer, raw: redis.Redis, ns: str, stored: int, counter: str, kept: bool
) -> None:
    name, value = _manifest_record(ns, "k", 100_000, stored)
    raw.set(name, value)
    store = RedisStore(redis_server.url, namespace=ns, timeout=LOADED)
    raw.config_resetstat()
    assert store.get("k") is None
    assert _misses(raw) == 0  # not one chunk looked up
    assert getattr(store.counters, counter) == 1
    assert raw.exists(name) == int(kept)
    raw.delete(name)


def test_missing_chunks_stop_the_read_at_the_first_call(
    redis_server: RedisServer, raw: redis.Redis, ns: str
) -> None:
    name, value = _manifest_record(ns, "k", 2000, 2000 * CHUNK)  # 125 MiB, none of it there
    raw.set(name, value)
    store = RedisStore(redis_server.url, namespace=ns, timeout=LOADED)
    raw.config_resetstat()
    assert store.get("k") is None
    assert store.counters.corrupt == 1
    assert _misses(raw) == fmt.MAX_CHUNK_SIZE // CHUNK  # one call's worth of chunks, not 2000


def test_max_entry_size_is_configurable_and_binds_both_ways(
    redis_server: RedisServer, ns: str
) -> None:
    big = Entry({"a": os.urandom(3 << 20)})
    small_limit = RedisStore(f"{redis_server.url}?max_entry_size=2M", namespace=ns, timeout=LOADED)
    assert small_limit.max_entry_size == 2 << 20
    with pytest.raises(StoreError, match="max_entry_size"):
        small_limit.put("k", big)
    RedisStore(redis_server.url, namespace=ns, timeout=LOADED, chunk_size=1 << 20).put("k", big)
    assert small_limit.get("k") is None
    assert small_limit.counters.oversized == 1
    assert (
        RedisStore(redis_server.url, namespace=ns, timeout=LOADED).get("k") == big
    )  # left for the peer


# Remembered bad values ---------------------------------------------------------------------
def test_bad_values_are_forgotten_after_a_while_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The memory's own clock, moved by hand: with a real one, a loaded machine that
    # stalled this thread for 50 ms between add and holds failed the test.
    now = [1000.0]
    monkeypatch.setattr(badvalues, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    bad = BadValues(seconds=60, limit=3)
    for name in "abcd":
        bad.add(name)
    assert len(bad) == 3
    assert not bad.holds("a")
    now[0] += 59.9
    assert bad.holds("d")  # the oldest made room
    now[0] += 0.2
    assert not bad.holds("d")
    assert len(bad) == 2


def test_values_remembered_as_bad_are_read_again_later(
    redis_server: RedisServer, raw: redis.Redis, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore(redis_server.url, namespace=ns, timeout=LOADED, read_only=True)
    raw.set(_name(ns, "k"), b"garbage")
    assert store.get("k") is None
    assert store.counters.corrupt == 1
    RedisStore(redis_server.url, namespace=ns, timeout=LOADED).put(
        "k", Entry({"a": b"fixed"})
    )  # repaired
    assert store.get("k") is None  # still remembered as bad
    # Later: the memory's clock moved past BAD_SECONDS (not slept: a loaded machine's
    # repair put could outlast a short memory and fail the line above; issue 20).
    later = time.monotonic() + store.bad.seconds + 1
    monkeypatch.setattr(badvalues, "time", types.SimpleNamespace(monotonic=lambda: later))
    assert store.get("k") is not None
