"""The fast paths taken for speed keep the exact behaviour of the slow ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import xxhash

from kernelcache import CorruptEntry, DiskStore, Entry
from kernelcache import entry_format as entry_module
from kernelcache.entry_format import PREFIX_SIZE, header_size, parse_header, validate_name
from kernelcache.stores import base
from kernelcache.stores.base import validate_key


class _SneakyStr(str):
    """Equal to (and hashing like) any key: must never pass as an already-checked key."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("a" * 64)


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier's faults here are injected into entry files' reads and writes: small
    entries go into files, as before packing. Packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def test_validate_key_memo_accepts_and_rejects_as_the_regex_does() -> None:
    good = "a" * 64
    assert validate_key(good) is good
    assert validate_key(good) is good  # second time: from the memo
    for bad in ("", ".x", "-x", "a/b", "a" * 201, "ä", "a b", None, 1, b"abc", ["a"]):
        with pytest.raises(ValueError, match="invalid cache key"):
            validate_key(bad)
        with pytest.raises(ValueError, match="invalid cache key"):
            validate_key(bad)  # a rejected key is never remembered
    with pytest.raises(ValueError, match="invalid cache key"):
        validate_key(_SneakyStr("../../etc/passwd"))


def test_validate_key_memo_stays_bounded() -> None:
    # The memo's size is the property under test, and nothing public shows it.
    memo, bound = base._VALID_KEYS, base._VALID_KEYS_MAX  # noqa: SLF001
    for i in range(bound + 10):
        validate_key(f"k{i}")
    assert len(memo) <= bound
    assert validate_key("k1") == "k1"  # still valid after the memo was cleared


# Disk reads: the first read (the whole entry up to 8 KB, else 2 KB) may hold
# the whole entry, part of the header, or the header and part of an artifact;
# every split must read back.
@pytest.mark.parametrize(
    ("meta_bytes", "sizes"),
    [
        pytest.param(0, [0], id="empty-artifact"),
        pytest.param(0, [100, 200], id="all-in-first-read"),
        pytest.param(0, [8000], id="artifact-crosses-first-read"),
        pytest.param(0, [8192 - 180, 5], id="first-artifact-ends-near-boundary"),
        pytest.param(0, [70_000, 3, 70_000], id="big-small-big"),
        pytest.param(20_000, [10], id="header-longer-than-first-read"),
        pytest.param(9_000, [0, 9_000], id="long-header-and-artifact"),
        pytest.param(3_000, [10_000], id="header-longer-than-head-read"),
        pytest.param(0, [1_500, 10_000], id="small-artifact-inside-head-read"),
        pytest.param(0, [1_900, 10_000, 1], id="artifact-crosses-head-read"),
    ],
)
def test_disk_reads_every_layout(tmp_path: Path, meta_bytes: int, sizes: list[int]) -> None:
    artifacts = {f"a{i}": bytes([i + 1]) * size for i, size in enumerate(sizes)}
    entry = Entry(artifacts, meta={"pad": "m" * meta_bytes})
    with DiskStore(tmp_path / "d") as store:
        store.put("k" * 64, entry)
        got = store.get("k" * 64)
        assert got is not None
        assert dict(got) == artifacts
        assert got.meta == {"pad": "m" * meta_bytes}
        assert got == entry


def test_parse_header_bytes_and_memoryview_agree() -> None:
    packed = Entry({"x": b"1" * 10, "y": b"2" * 5}, meta={"n": 1}).pack("key1")
    for form in (packed, memoryview(packed), memoryview(bytearray(packed))):
        header = parse_header(form)
        assert (header.key, header.meta_raw, header.total_size) == ("key1", b'{"n":1}', len(packed))
        assert [row[:2] for row in header.table] == [("x", 10), ("y", 5)]
    assert dict(Entry.unpack(bytearray(packed))) == {"x": b"1" * 10, "y": b"2" * 5}


@pytest.mark.parametrize("cut", [0, 5, PREFIX_SIZE, PREFIX_SIZE + 3, 60, -20, -1])
def test_disk_truncated_entry_is_a_counted_miss(tmp_path: Path, cut: int) -> None:
    with DiskStore(tmp_path / "d") as store:
        store.put("k1", Entry({"a": b"z" * 20_000}))
        (path,) = (tmp_path / "d").glob("v1/entries/*/k1.kce")
        data = path.read_bytes()
        path.write_bytes(data[:cut])
        assert store.get("k1") is None
        assert store.counters.corrupt == 1
        assert not path.exists()  # a bad entry is removed


def _forge_name(packed: bytes, old: bytes, new: bytes) -> bytes:
    """The packed entry with an artifact name swapped and the header checksum redone."""
    end = header_size(packed)
    body = packed[: end - 16].replace(old, new)
    return body + xxhash.xxh3_128_digest(body) + packed[end:]


@pytest.mark.parametrize("bad", [b"../x", b"a/bc", b"a\\bc", b"ab\0c", b"..", b"."])
def test_crafted_unsafe_name_is_corrupt_even_with_a_valid_checksum(bad: bytes) -> None:
    name = "n" * len(bad)
    validate_name(name)  # a good name is remembered; a bad one must never be
    forged = _forge_name(Entry({name: b"1"}).pack("k1"), name.encode(), bad)
    for _ in range(2):
        with pytest.raises(CorruptEntry, match="malformed"):
            Entry.unpack(forged)
    with pytest.raises(ValueError, match="unsafe artifact name"):
        validate_name(bad.decode())


def test_validate_name_memo_stays_bounded() -> None:
    # The memo's size is the property under test, and nothing public shows it.
    memo, bound = entry_module._VALID_NAMES, entry_module._VALID_NAMES_MAX  # noqa: SLF001
    for i in range(bound + 10):
        validate_name(f"n{i}.cubin")
    assert len(memo) <= bound
    with pytest.raises(ValueError, match="must be str"):
        validate_name(b"n1.cubin")


def test_eviction_removes_extracted_files_of_evicted_entries(tmp_path: Path) -> None:
    root = tmp_path / "d"
    with DiskStore(root, max_bytes=64 * 1024) as store:
        keys = [f"k{i:03d}" for i in range(120)]
        for key in keys:
            store.put(key, Entry({"data": key.encode() * 100}))
            got = store.get(key)
            assert got is not None
            assert Path(got.path("data")).read_bytes() == key.encode() * 100
        assert store.counters.evictions > 0
        live = set(store.keys())
        assert live
        assert live != set(keys)
        folders = {p.name for p in root.glob("v1/extracted/*/*")}
        assert folders <= live  # nothing extracted is left of an evicted entry
        on_disk = sum(p.stat().st_size for p in root.glob("v1/entries/*/*.kce")) + sum(
            p.stat().st_size for p in root.glob("v1/extracted/*/*/*/*")
        )
        assert store.usage() == (len(live), on_disk)


def test_clear_removes_entries_and_their_extracted_files(tmp_path: Path) -> None:
    root = tmp_path / "d"
    with DiskStore(root) as store:
        for i in range(40):
            store.put(f"k{i}", Entry({"a": b"x" * i, "b": b"y"}))
            got = store.get(f"k{i}")
            assert got is not None
            got.path("a")
        (root / "v1" / "entries" / "0" / "foreign.txt").write_text("not ours")
        assert store.clear() == 40
        assert list(root.glob("v1/entries/*/*.kce")) == []
        assert list(root.glob("v1/extracted/*/*")) == []
        assert (root / "v1" / "entries" / "0" / "foreign.txt").exists()
        assert store.usage() == (0, 0)
