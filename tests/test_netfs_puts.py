"""What a put costs on a network filesystem, in requests the server answers (issue 40).

Each request is a round trip on NFS; counted by the FUSE harness (tests/netfs.py),
they are deterministic for one process: no clock, no other writer. A put here is
``Cache.get_or_compile`` of a new key: the miss, the single-flight lease, the
lookup probe, the staged file, the space lease and the publish. The bound comes
from the measurement (89 requests with names and attributes not cached; 185
before the put path's folders were opened once and the probe left the space
lease), with a little room for a filesystem that answers one more lookup.
"""

from __future__ import annotations

from collections.abc import Callable

from kernelcache import Cache, Entry
from kernelcache.stores import DiskStore
from netfs import NetFS

#: Requests one put may cost, names and attributes not cached (Triton's FileCacheManager: 66).
PUT_REQUESTS_MAX = 100


def test_a_put_on_a_network_filesystem_costs_a_bounded_number_of_requests(
    two_nodes: Callable[..., NetFS],
) -> None:
    fs = two_nodes()
    node = fs.nodes[0]
    store = DiskStore(node.path / "cache", max_bytes=1 << 30)
    assert store.filesystem.network  # leases, the lookup probe: the network put path
    cache = Cache([store], persist_stats=False)
    cache.get_or_compile("warm" * 16, lambda: Entry({"x": b"warm"}))  # folders made
    costs = []
    for i in range(3):
        before = node.counts()
        got = cache.get_or_compile(f"{i:064x}", lambda: Entry({"x": b"y" * 4096}))
        assert got["x"] == b"y" * 4096
        costs.append(node.round_trips(before))
    assert store.stats()["puts"] == 4
    assert store.stats()["errors"] == 0
    assert max(costs) <= PUT_REQUESTS_MAX, costs
    # Each lease and probe file made was removed again: only the entries are left.
    assert store.usage() == store.recount()
    assert sorted(store.keys()) == sorted(["warm" * 16, *(f"{i:064x}" for i in range(3))])
    store.close()


def test_a_probe_file_is_no_entry_to_a_removal(two_nodes: Callable[..., NetFS]) -> None:
    """The lookup probe runs without the space lease: a removal that meets its empty file
    must neither count it (it never was) nor report an entry removed."""
    fs = two_nodes()
    store = DiskStore(fs.nodes[0].path / "cache")
    store.put("a" * 64, Entry({"x": b"kept"}))
    key = "b" * 64
    with open(store.layout.entry_path(key), "wb"):
        pass  # the empty file a lookup probe makes while it looks
    assert not store.delete(key)
    kept = store.info("a" * 64)
    assert kept is not None
    assert store.usage() == (1, kept.size)
    assert store.stats()["deletes"] == 0
    store.close()
