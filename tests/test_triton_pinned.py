"""The pinned tier: an entry's files verified once per process, then vouched for by a stat.

No Triton needed: any entry whose files the disk tier extracts. The timestamp
rule (files younger than the granularity are never pinned) is lifted where a
test needs pins at once, as the other stat-trusting tests do.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kernelcache import Cache, DiskStore, Entry, _fs
from kernelcache.triton.pinned import PinnedTier

ARTIFACTS = {"k.cubin": b"\x7fELF" + bytes(range(256)) * 8, "k.json": b'{"name": "k"}'}
KEY = "0123456789abcdef"


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Cache, PinnedTier, DiskStore]:
    pinned, disk = PinnedTier(), DiskStore(tmp_path / "kc")
    cache = Cache([pinned, disk], persist_stats=False)
    cache.put(KEY, Entry(ARTIFACTS, meta={"compile_seconds": 2.0}))
    return cache, pinned, disk


@pytest.fixture
def old_files_vouch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)


def _paths(entry: Entry | None) -> dict[str, str]:
    assert entry is not None
    return {name: entry.path(name) for name in entry}


def _contents(paths: dict[str, str]) -> dict[str, bytes]:
    return {name: Path(path).read_bytes() for name, path in paths.items()}


@pytest.mark.usefixtures("old_files_vouch")
def test_second_hit_reads_nothing_from_the_disk_tier(
    tiers: tuple[Cache, PinnedTier, DiskStore],
) -> None:
    cache, pinned, disk = tiers
    pinned.clear()  # as a new process starts: nothing pinned yet
    first = _paths(cache.get(KEY))  # from disk: read, verified, then pinned
    assert disk.counters.hits == 1
    assert pinned.usage()[0] == 1
    read = disk.counters.bytes_read
    for _ in range(3):
        assert _paths(cache.get(KEY)) == first
    assert pinned.counters.hits == 3
    assert disk.counters.hits == 1
    assert disk.counters.bytes_read == read
    assert _contents(first) == ARTIFACTS
    # Pinned hits count as hits that saved the entry's compile time.
    assert cache.stats()["pinned"]["seconds_saved"] == pytest.approx(6.0)


def test_files_too_young_to_vouch_for_are_not_pinned(
    tiers: tuple[Cache, PinnedTier, DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Young for an hour: with the real 2 s, a loaded machine that took that long
    # between the put and a get found the files old enough, and pinned them.
    monkeypatch.setattr(_fs, "TOO_NEW_NS", 3600 * 10**9)
    cache, pinned, disk = tiers
    for _ in range(2):
        assert _contents(_paths(cache.get(KEY))) == ARTIFACTS
    assert pinned.usage() == (0, 0)
    assert pinned.counters.young >= 2
    assert disk.counters.hits == 2  # each hit read and verified the entry again


@pytest.mark.usefixtures("old_files_vouch")
def test_a_file_altered_in_place_is_never_served(
    tiers: tuple[Cache, PinnedTier, DiskStore],
) -> None:
    cache, pinned, _ = tiers
    path = Path(_paths(cache.get(KEY))["k.cubin"])
    time.sleep(0.05)  # past the clock tick of the pin (the rule this test lifted guards it)
    with open(path, "r+b") as f:  # same size, other bytes
        f.write(b"EVIL")
    assert pinned.get(KEY) is None
    assert pinned.counters.changed == 1
    served = _paths(cache.get(KEY))  # the disk tier serves, and nothing pins the bad file
    assert _contents(served) == ARTIFACTS


@pytest.mark.usefixtures("old_files_vouch")
def test_a_file_replaced_by_a_symlink_is_never_served(
    tiers: tuple[Cache, PinnedTier, DiskStore], tmp_path: Path
) -> None:
    cache, pinned, disk = tiers
    path = Path(_paths(cache.get(KEY))["k.json"])
    decoy = tmp_path / "decoy.json"
    decoy.write_bytes(ARTIFACTS["k.json"])  # even with the right bytes: a link is not followed
    os.unlink(path)
    os.symlink(decoy, path)
    assert pinned.get(KEY) is None
    served = _paths(cache.get(KEY))
    assert not Path(served["k.json"]).is_symlink()
    assert _contents(served) == ARTIFACTS
    # The disk tier refuses the link itself (and extracts the file again) before
    # the pinned tier reads it; either way the refusal is counted.
    assert pinned.counters.refused + disk.counters.refused >= 1


@pytest.mark.usefixtures("old_files_vouch")
def test_a_removed_file_is_extracted_again_and_pinned_again(
    tiers: tuple[Cache, PinnedTier, DiskStore],
) -> None:
    cache, pinned, disk = tiers
    path = Path(_paths(cache.get(KEY))["k.cubin"])
    # Pinned by then, by the put or by this get: the put's files can carry a
    # coarse-clock mtime just past the instant its pin began, which is too young.
    assert pinned.get(KEY) is not None
    before = disk.counters.hits
    path.unlink()
    assert _contents(_paths(cache.get(KEY))) == ARTIFACTS  # from disk, extracted again
    assert pinned.counters.changed == 1
    assert disk.counters.hits == before + 1
    # The new file was written after that lookup began (too young for it): the next one pins.
    _paths(cache.get(KEY))
    assert pinned.get(KEY) is not None


@pytest.mark.usefixtures("old_files_vouch")
def test_a_republished_key_drops_the_old_pin(tiers: tuple[Cache, PinnedTier, DiskStore]) -> None:
    cache, _, _ = tiers
    _paths(cache.get(KEY))
    newer = {"k.cubin": b"\x7fELF newer", "k.json": b"{}"}
    cache.put(KEY, Entry(newer))
    assert _contents(_paths(cache.get(KEY))) == newer


@pytest.mark.usefixtures("old_files_vouch")
def test_caps_evict_the_least_recently_used(tmp_path: Path) -> None:
    pinned, disk = PinnedTier(max_entries=1), DiskStore(tmp_path / "kc")
    cache = Cache([pinned, disk], persist_stats=False)
    for key in ("aaaa", "bbbb"):
        cache.put(key, Entry(ARTIFACTS))
        _paths(cache.get(key))
    assert list(pinned.keys()) == ["bbbb"]
    assert pinned.counters.evictions == 1
    assert pinned.usage()[0] == 1
    assert pinned.delete("bbbb")
    assert not pinned.delete("bbbb")
    assert pinned.clear() == 0
    with pytest.raises(ValueError, match="max_bytes must be a positive int or None"):
        PinnedTier(max_bytes=-1)
