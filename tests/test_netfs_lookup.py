"""The leader's look after the lease sees another node's entry, whatever this node cached (issue 22).

A waiter on node b takes the key's lease after node a published the entry;
its lookup must find that entry, although b cached the name earlier, for as
long as an NFS client does (``actimeo``, ``lookupcache``): absent, or naming
the empty file of another leader's lookup probe (``DiskStore._revalidate``),
removed since. These are the deterministic cases of the stampede in
tests/test_netfs_modes.py (its attr-lag mode met the second once, as two
compiles of one key). The same stale name misled a removal's inode check
(eviction): it took the entry that another node had put in place since, and
a lease takeover's check of the record it took: it removed the live lease
that another node had taken over first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kernelcache import Cache, Entry
from kernelcache.stores import DiskStore
from kernelcache.stores.disk.netpublish import lstat_fresh
from kernelcache.stores.lease import LeaseLock, read_record, take
from netfs import Faults, NetFS

KEY = "ab" * 32
DATA = b"published by node a"


def _backing(fs: NetFS, path: str) -> Path:
    """``path`` under node a's mount, as the backing directory holds it."""
    return fs.backing / os.path.relpath(path, fs.nodes[0].path)


@pytest.mark.parametrize("seen", ["absent", "probe-file"])
def test_a_lease_holder_finds_the_entry_another_node_published(
    two_nodes: Callable[..., NetFS], seen: str
) -> None:
    # Names and attributes trusted for a minute: far longer than the test runs.
    fs = two_nodes("shared", Faults(attr_timeout_ms=60_000))
    a = DiskStore(fs.nodes[0].path / "cache")
    b = DiskStore(fs.nodes[1].path / "cache")
    assert a.filesystem.network  # leases and the lookup probe: the network code path
    assert b.filesystem.network
    entry_file = _backing(fs, a.layout.entry_path(KEY))
    if seen == "probe-file":
        entry_file.write_bytes(b"")  # another leader's probe, as node b sees it in passing
    assert b.get(KEY) is None  # node b caches the name: absent, or the empty file
    entry_file.unlink(missing_ok=True)  # the probe is over
    a.put(KEY, Entry({"x": DATA}))
    compiled: list[bytes] = []
    got = _get_or_compile(b, compiled)
    assert compiled == []
    assert got == DATA
    assert entry_file.stat().st_size > 0  # the entry is still there, on the server
    assert b.stats()["errors"] == 0
    a.close()
    b.close()


def test_a_lease_holder_that_finds_no_entry_compiles_once_and_leaves_no_probe_file(
    two_nodes: Callable[..., NetFS],
) -> None:
    fs = two_nodes("shared", Faults(attr_timeout_ms=60_000))
    b = DiskStore(fs.nodes[1].path / "cache")
    entry_file = _backing(fs, b.layout.entry_path(KEY))
    b.space.probe(KEY)  # nothing there: the file it made is gone again
    assert not entry_file.exists()
    compiled: list[bytes] = []
    assert _get_or_compile(b, compiled) == b"compiled on node b"
    assert compiled == [b"compiled on node b"]
    assert entry_file.stat().st_size > 0
    assert b.usage() == (1, entry_file.stat().st_size)  # the probe's file was never counted
    b.close()


def _get_or_compile(store: DiskStore, compiled: list[bytes]) -> bytes:
    """``Cache.get_or_compile`` over ``store`` alone; each compile appended to ``compiled``."""

    def compile_fn() -> Entry:
        compiled.append(b"compiled on node b")
        return Entry({"x": compiled[-1]})

    return Cache([store], persist_stats=False).get_or_compile(KEY, compile_fn)["x"]


def test_a_removal_judged_on_a_cached_name_spares_the_entry_that_replaced_it(
    two_nodes: Callable[..., NetFS],
) -> None:
    """Eviction on node b chose the entry it knows (its inode); node a has replaced it
    since. The rename into staging takes whatever the name holds on the server, so the
    inode check must look at that file, not at what b's name cache still says."""
    fs = two_nodes("shared", Faults(attr_timeout_ms=60_000))
    a = DiskStore(fs.nodes[0].path / "cache")
    b = DiskStore(fs.nodes[1].path / "cache")
    a.put(KEY, Entry({"x": b"first"}))
    old = b.info(KEY)  # node b caches the name: the first entry
    assert old is not None
    a.put(KEY, Entry({"x": DATA}))  # replaced on node a (same size or not: a new file)
    assert not b.remove_if_unchanged(old)
    entry_file = _backing(fs, a.layout.entry_path(KEY))
    assert entry_file.stat().st_size > 0
    assert a.get(KEY) is not None
    assert a.usage() == (1, entry_file.stat().st_size)
    a.close()
    b.close()


def test_a_takeover_that_cannot_read_what_it_took_puts_it_back(
    two_nodes: Callable[..., NetFS],
) -> None:
    """Node b judged the lease dead, but node a holds it now. b's takeover renames the
    file away, then cannot read it (EIO): unjudged, it must go back under its name, and
    the error reach b's retry loop; a keeps its lease."""
    fs = two_nodes("shared")
    a, b = (str(node.path / "x.lease") for node in fs.nodes)
    live = LeaseLock(a, lease=600)
    assert live.acquire(10)
    held = read_record(a)
    fs.nodes[1].set(Faults(eio_ppm=1_000_000, eio_ops=("open",)))
    try:
        with pytest.raises(OSError, match="Input/output error"):
            take(b, lambda record: record == b"otherhost - 1 deadnonce 0\n")
    finally:
        fs.nodes[1].set(Faults())
    assert (fs.backing / "x.lease").read_bytes() == held
    assert [p.name for p in fs.backing.iterdir()] == ["x.lease"]  # no private name left
    live.release()
    assert not live.lost
    assert not (fs.backing / "x.lease").exists()


def test_lstat_fresh_of_a_missing_name_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        lstat_fresh(str(tmp_path / "gone"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "there").write_bytes(b"12")
    assert lstat_fresh(str(tmp_path / "there")).st_size == 2


def test_a_takeover_judged_on_a_cached_name_spares_the_lease_taken_since(
    two_nodes: Callable[..., NetFS],
) -> None:
    """Waiters on both nodes judge one lease dead; node a takes it over and holds a new one.
    Node b's takeover renames away what the name holds on the server (a's new lease), and
    must read that file's record, not the dead one its name cache still shows."""
    fs = two_nodes("shared", Faults(attr_timeout_ms=60_000))
    a, b = (str(node.path / "x.lease") for node in fs.nodes)
    dead = b"otherhost - 1 deadnonce 0\n"
    (fs.backing / "x.lease").write_bytes(dead)
    assert read_record(b) == dead  # node b judges it: dead (no beat for the lease time)
    assert take(a, lambda record: record == dead)  # node a was first
    live = LeaseLock(a, lease=600)
    assert live.acquire(10)
    try:
        assert not take(b, lambda record: record == dead)
        assert read_record(a) is not None
        assert (fs.backing / "x.lease").read_bytes() != dead
    finally:
        live.release()
    assert not live.lost
