"""A machine that cannot verify the team's signed entries never replaces them (issue 20, item 2).

Before: B (no secret, or another one) found A's entry unverifiable, compiled and
wrote over it; A then found its own key forged, compiled and wrote back: every
hit of the team became a miss. See kernelcache/stores/redis/keyless.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import redis

from kernelcache import Cache, Entry, MemoryStore
from kernelcache.errors import StoreError
from kernelcache.stores.redis import RedisStore
from redis_cluster import LocalCluster
from redis_server import LOADED, RedisServer

TEAM = "the team's secret"


def _store(url: str, ns: str, secret: str | None) -> RedisStore:
    return RedisStore(url, namespace=ns, secret=secret, timeout=LOADED, chunk_size=64 << 10)


@pytest.mark.parametrize(
    ("secret", "cause"),
    [pytest.param(None, "has no secret", id="keyless"),
     pytest.param("another secret", "does not verify", id="wrong-secret")],
)  # fmt: skip
def test_a_signed_entry_is_never_replaced_by_who_cannot_verify_it(
    redis_server: RedisServer,
    raw: redis.Redis,
    ns: str,
    caplog: pytest.LogCaptureFixture,
    secret: str | None,
    cause: str,
) -> None:
    a = _store(redis_server.url, ns, TEAM)
    b = _store(redis_server.url, ns, secret)
    team_cache = Cache([MemoryStore(), a], persist_stats=False)
    compiles: list[str] = []

    def compile_(who: str) -> Entry:
        compiles.append(who)
        return Entry({"k.cubin": who.encode()})

    assert team_cache.get_or_compile("k", lambda: compile_("a"))["k.cubin"] == b"a"
    with caplog.at_level(logging.WARNING, logger="kernelcache"):
        for _ in range(3):  # B's builds, again and again
            laptop = Cache([MemoryStore(), b], persist_stats=False)
            assert laptop.get_or_compile("k", lambda: compile_("b"))["k.cubin"] == b"b"
            for size in (10, 300_000):  # inline and chunked records
                with pytest.raises(StoreError, match="kept the signed entry"):
                    b.put("k", Entry({"k.cubin": b"b" * size}))
    assert b.counters.not_replaced == 9
    staged = list(raw.scan_iter(f"kc:{ns}:c:*"))
    assert staged == []  # the refused chunked puts' chunks were removed, not left to expire
    said = [r.getMessage() for r in caplog.records if "signed entries" in r.getMessage()]
    assert len(said) == 1
    assert cause in said[0]
    assert ns in said[0]
    # The team still hits, in a fresh process, and never counts its own key as forged.
    fresh = Cache([MemoryStore(), _store(redis_server.url, ns, TEAM)], persist_stats=False)
    assert fresh.get_or_compile("k", lambda: compile_("a2"))["k.cubin"] == b"a"
    assert compiles == ["a", "b", "b", "b"]
    assert fresh.stats()["redis"]["forged"] == 0


def test_a_keyless_entry_is_replaced_by_the_team_and_never_the_other_way(
    redis_server: RedisServer, ns: str
) -> None:
    keyless = _store(redis_server.url, ns, None)
    team = _store(redis_server.url, ns, TEAM)
    keyless.put("k", Entry({"a": b"unsigned"}))  # absent: a keyless machine may add it
    assert team.get("k") is None
    assert team.counters.forged == 1  # not read by the team ...
    team.put("k", Entry({"a": b"signed"}))  # ... and replaced by it
    assert team.get("k")["a"] == b"signed"  # type: ignore[index]
    with pytest.raises(StoreError):
        keyless.put("k", Entry({"a": b"unsigned again"}))
    assert team.get("k")["a"] == b"signed"  # type: ignore[index]
    team.put("k", Entry({"a": b"signed, newer"}))  # the team replaces its own entries
    assert team.get("k")["a"] == b"signed, newer"  # type: ignore[index]
    assert team.counters.not_replaced == 0


def test_a_signed_entry_failing_its_mac_is_kept_even_by_the_team(
    redis_server: RedisServer, raw: redis.Redis, ns: str
) -> None:
    """A bad MAC looks the same whether a bit flipped or another secret signed it: kept
    (replacing it would restart the ping-pong between two secrets); TTL or `clear --remote`
    remove it. A truncated record, plainly damaged, is repaired."""
    team = _store(redis_server.url, ns, TEAM)
    name = f"kc:{ns}:e:{{k}}"
    team.put("k", Entry({"a": os.urandom(100)}))
    value = bytearray(raw.get(name))  # type: ignore[arg-type]
    value[3] ^= 0xFF
    raw.set(name, bytes(value))
    assert team.get("k") is None
    with pytest.raises(StoreError, match="kept the signed entry"):
        team.put("k", Entry({"a": b"repaired"}))
    assert team.counters.not_replaced == 1
    raw.set(name, bytes(value[-20:]))  # a trailer alone: too short to hold its MAC
    team.put("k", Entry({"a": b"repaired"}))
    assert team.get("k")["a"] == b"repaired"  # type: ignore[index]


def test_kept_on_a_cluster_too(redis_cluster: LocalCluster) -> None:
    ns = f"keyless{os.getpid()}"
    team = _store(redis_cluster.url, ns, TEAM)
    keyless = _store(redis_cluster.url, ns, None)
    team.put("k", Entry({"a": b"signed"}))
    for size in (10, 300_000):
        with pytest.raises(StoreError, match="kept the signed entry"):
            keyless.put("k", Entry({"a": b"x" * size}))
    assert team.get("k")["a"] == b"signed"  # type: ignore[index]
    team.delete("k")
