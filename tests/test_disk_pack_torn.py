"""A packed slot read torn by a concurrent writer is a miss, never a reason to remove.

A reader takes a slot's fields with one unaligned copy out of the shared mapping
while a writer may be filling it: on a weakly ordered CPU (aarch64) it can see the
hash before the offset and length, and anywhere it can see a tombstoned slot that
another key's put took over between its probe and its read (stores/disk/pack.py).
Neither can be forced on this x86 machine, so the reader's view of the slot is
replaced, once, by what such a read returns; the pack's bytes stay real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from disk_entries import entry, in_shard
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.disk.packindex import ShardIndex

SHARD = "5"


def _torn_once(monkeypatch: pytest.MonkeyPatch, tear: tuple[int, int, int, int, int]) -> list[bool]:
    """The next slot a hit reads is ``tear`` applied to it: ``(hash, offset, length, flags,
    clock)`` deltas; returns a list that records that it happened."""
    real = ShardIndex.slot
    torn: list[bool] = []

    def slot(self: ShardIndex, i: int) -> tuple[int, int, int, int, int]:
        got = real(self, i)
        if torn:
            return got
        torn.append(True)
        return tuple(a + b for a, b in zip(got, tear, strict=True))  # type: ignore[return-value]

    monkeypatch.setattr(ShardIndex, "slot", slot)
    return torn


def test_a_torn_length_is_a_miss_and_the_record_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot's new offset seen with a length from before: the read fails verification,
    but the record the slot names is whole, so it is not removed."""
    key = in_shard(SHARD, 1, "t")[0]
    DiskStore(tmp_path / "c").put(key, entry(key))
    reader = DiskStore(tmp_path / "c")
    torn = _torn_once(monkeypatch, (0, 0, -100, 0, 0))
    assert reader.get(key) is None  # what the torn read saw: a counted miss
    assert torn
    assert reader.get(key) == entry(key)  # still there
    assert DiskStore(tmp_path / "c").get(key) == entry(key)


def test_a_slot_another_key_took_is_a_miss_not_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the probe and the read the key was removed and another key's put took its
    slot: the slot's hash is no longer the key's, so the read is a plain miss (no damage
    counted, nothing removed)."""
    key, other = in_shard(SHARD, 2, "u")
    store = DiskStore(tmp_path / "c")
    store.put(key, entry(key))
    store.put(other, entry(other))
    reader = DiskStore(tmp_path / "c")
    info = reader.info(other)
    assert info is not None
    mine = reader.info(key)
    assert mine is not None
    shift = info.extra["record"] - mine.extra["record"]
    _torn_once(monkeypatch, (1, shift, 0, 0, 0))  # another hash, another record
    assert reader.get(key) is None
    assert reader.counters.corrupt == 0
    assert reader.get(key) == entry(key)
    assert reader.get(other) == entry(other)


def test_a_record_damaged_for_real_is_still_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-check under the lock keeps a whole record only: a damaged one goes, as before."""
    from disk_entries import flip_packed_byte

    key = in_shard(SHARD, 1, "v")[0]
    store = DiskStore(tmp_path / "c")
    store.put(key, entry(key))
    flip_packed_byte(store, key, 200)
    reader = DiskStore(tmp_path / "c")
    assert reader.get(key) is None
    assert reader.counters.corrupt == 1
    assert reader.info(key) is None  # removed
