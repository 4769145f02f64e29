"""The Redis tier over a real local Redis Cluster (three masters): slots, listing, a killed node."""

from __future__ import annotations

import os
import time
import types
from collections import Counter

import pytest
import redis
from redis.cluster import RedisCluster

from kernelcache import Cache, Entry
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.redis import RedisStore, breaker
from kernelcache.stores.redis import format as fmt
from redis_cluster import LocalCluster
from redis_server import LOADED, unique_namespace

CHUNK = fmt.MIN_CHUNK_SIZE


def _owner(cluster: LocalCluster, name: str) -> int:
    """Index of the node that holds the key ``name`` (asked of the nodes themselves)."""
    for i, node in enumerate(cluster.nodes):
        client = redis.Redis(port=node.port, socket_timeout=2)
        try:
            slot = client.execute_command("CLUSTER", "KEYSLOT", name)
            if client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) and client.exists(name):
                return i
        finally:
            client.close()
    raise AssertionError(f"no node holds {name}")


@pytest.mark.parametrize("form", ["scheme", "query"])
def test_cluster_urls_select_redis_cluster_with_bounded_connections(
    redis_cluster: LocalCluster, form: str
) -> None:
    url = redis_cluster.url
    if form == "query":
        url = url.replace("redis+cluster://", "redis://") + "?cluster=1"
    store = RedisStore(url, namespace=unique_namespace(), timeout=LOADED)
    assert store.cluster
    assert "cluster" in repr(store)
    entry = Entry({"kernel.cubin": os.urandom(5000)})
    store.put("k", entry)
    assert store.get("k") == entry
    client = store.guard.call(lambda client: client)
    assert isinstance(client, RedisCluster)
    for _name, node in store.guard.nodes():  # every node's pool makes deadline-bound sockets
        assert node.connection_pool.connection_class.__name__ == "BoundedConnection"
    store.close()


def test_an_entry_its_chunks_and_its_lease_live_in_one_slot(redis_cluster: LocalCluster) -> None:
    ns = unique_namespace()
    store = RedisStore(
        redis_cluster.url, namespace=ns, chunk_size=CHUNK, compress_min=1 << 30, timeout=LOADED
    )
    entry = Entry({"blob": os.urandom(5 * CHUNK)})
    store.put("k", entry)  # the Lua publish touches the record and every chunk: one slot
    lock = store.flight_lock("k")
    assert lock is not None
    assert lock.acquire(timeout=1)
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    names = [n.decode() for n in client.scan_iter(match=f"kc:{ns}:*", target_nodes="primaries")]
    assert len(names) == 1 + 5 + 1 + 1  # record, chunks, lease
    assert len({client.keyslot(name) for name in names}) == 1
    lock.release()
    assert store.get("k") == entry
    assert store.delete("k")
    assert store.get("k") is None
    client.close()


def test_listing_and_clearing_scan_every_node(redis_cluster: LocalCluster) -> None:
    ns = unique_namespace()
    store = RedisStore(
        redis_cluster.url, namespace=ns, secret="s", chunk_size=CHUNK, timeout=LOADED
    )
    for i in range(30):
        store.put(f"k{i}", Entry({"data": os.urandom(50 if i else 3 * CHUNK - 1000)}))
    owners = Counter(_owner(redis_cluster, f"kc:{ns}:e:{{k{i}}}") for i in range(30))
    assert len(owners) == 3  # the entries are spread over every master
    assert sorted(store.keys()) == sorted(f"k{i}" for i in range(30))
    infos = {info.key: info for info in store.scan()}
    assert len(infos) == 30
    assert infos["k0"].extra["chunks"] == 3
    assert infos["k1"].extra["signed"]
    assert store.clear() == 30
    assert list(store.keys()) == []


def test_read_only_readers_may_read_from_replicas(redis_cluster: LocalCluster) -> None:
    ns = unique_namespace()
    writer = RedisStore(redis_cluster.url, namespace=ns, timeout=LOADED)
    reader = RedisStore(f"{redis_cluster.url}?readonly=1&replicas=1", namespace=ns, timeout=LOADED)
    entry = Entry({"a": b"x" * 100})
    writer.put("k", entry)
    assert reader.read_only
    assert reader.get("k") == entry  # no replicas here: the primaries serve


def test_a_node_killed_mid_run_costs_misses_within_the_timeout_then_recovers(
    own_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead node refuses connections at once; the timeout only bounds a slow live one,
    # so it is generous enough for a loaded machine (issue 20) and calls stay bounded.
    # The breakers' clock moves by hand: with a real 0.5 s cooldown, a stall that long
    # among the lookups let one through as a probe (a second trip of the dead node's).
    now = [1000.0]
    monkeypatch.setattr(breaker, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    ns, timeout, cooldown = unique_namespace(), 2.0, 0.5
    store = RedisStore(
        own_cluster.url,
        namespace=ns,
        timeout=timeout,
        breaker_threshold=2,
        breaker_cooldown=cooldown,
    )
    cache = Cache([MemoryStore(), store])
    keys = [f"k{i}" for i in range(24)]
    entries = {key: Entry({"kernel.cubin": os.urandom(2000)}) for key in keys}
    with RedisStore(own_cluster.url, namespace=ns, timeout=LOADED) as setup:  # not timed
        for key in keys:
            setup.put(key, entries[key])
    owner = {key: _owner(own_cluster, f"kc:{ns}:e:{{{key}}}") for key in keys}
    dead = [key for key in keys if owner[key] == 1]
    alive = [key for key in keys if owner[key] != 1]
    assert dead
    assert alive

    own_cluster.kill(1)
    for _round in range(2):
        for key in keys:
            start = time.perf_counter()
            got = store.get(key) if key in alive else cache.get(key)
            assert time.perf_counter() - start < 10 * timeout
            assert (got == entries[key]) if key in alive else got is None
    # The dead node's breaker opened; the live nodes' never did.
    assert store.counters.errors >= 2
    assert store.counters.breaker_trips == 1
    assert store.stats()["open_nodes"] == [f"127.0.0.1:{own_cluster.nodes[1].port}"]
    assert store.counters.skipped >= len(dead)

    own_cluster.restart(1)  # back with its slots, empty
    deadline = time.monotonic() + 30
    while store.stats()["open_nodes"] and time.monotonic() < deadline:
        now[0] += cooldown  # the next call to the node is the breaker's probe
        cache.get(dead[0])
        time.sleep(0.1)
    for key in dead:
        assert store.get(key) is None  # its data died with it
        store.put(key, entries[key])
        assert store.get(key) == entries[key]
    store.close()


def test_a_slot_moved_under_a_reader_is_followed(own_cluster: LocalCluster) -> None:
    import binascii
    import subprocess

    from redis_cluster import CLI

    ns = unique_namespace()
    key = next(
        f"k{i}" for i in range(100_000) if binascii.crc_hqx(f"k{i}".encode(), 0) % 16384 == 0
    )
    store = RedisStore(own_cluster.url, namespace=ns, timeout=LOADED)
    entry = Entry({"kernel.cubin": os.urandom(2000)})
    store.put(key, entry)
    assert store.get(key) == entry  # this thread's connection to slot 0's owner is open
    assert _owner(own_cluster, f"kc:{ns}:e:{{{key}}}") == 0
    ids = [
        redis.Redis(port=node.port).execute_command("CLUSTER", "MYID").decode()
        for node in own_cluster.nodes
    ]
    subprocess.run(
        [str(CLI), "--cluster", "reshard", f"127.0.0.1:{own_cluster.nodes[0].port}",
         "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "1",
         "--cluster-yes"],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    own_cluster.wait_until_ok()
    assert _owner(own_cluster, f"kc:{ns}:e:{{{key}}}") == 1  # slot 0 moved, with the entry
    assert store.get(key) == entry  # MOVED from the old owner, followed by RedisCluster
    assert store.counters.errors == 0
    store.put(key, entry)
    assert store.get(key) == entry
    store.close()
