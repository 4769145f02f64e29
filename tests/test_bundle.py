"""The bundle format: round trip, and every truncation or alteration refused."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest

from kernelcache import Entry
from kernelcache.bundle import BundleError, BundleWriter, entries, verify

ENTRIES = {
    "k1": Entry({"a.cubin": b"\x7fELF" + bytes(200), "a.ptx": b"ptx"}, meta={"name": "a"}),
    "k2": Entry({"data": b""}, meta={}),
    "k3": Entry({"x": bytes(range(256))}, meta={"compile_seconds": 0.5}),
}


def write(path: Path, items: dict[str, Entry] = ENTRIES) -> bytes:
    buffer = io.BytesIO()
    writer = BundleWriter(buffer)
    for key, entry in items.items():
        writer.add(entry, key)
    writer.finish()
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "b.kcb"
    write(path)
    assert verify(path)[0] == 3
    got = {e.key: e for e in entries(path)}
    assert got == ENTRIES
    assert all(got[k].pack(k) == ENTRIES[k].pack(k) for k in ENTRIES)


def test_empty_bundle(tmp_path: Path) -> None:
    path = tmp_path / "b.kcb"
    write(path, {})
    assert verify(path) == (0, 0)


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    data = write(tmp_path / "full.kcb")
    cut = tmp_path / "cut.kcb"
    for size in range(len(data)):
        cut.write_bytes(data[:size])
        with pytest.raises(BundleError):
            verify(cut)


def test_every_flipped_byte_is_refused(tmp_path: Path) -> None:
    data = write(tmp_path / "full.kcb")
    bad = tmp_path / "bad.kcb"
    for pos in range(0, len(data), 3):
        flipped = bytearray(data)
        flipped[pos] ^= 0x40
        bad.write_bytes(bytes(flipped))
        with pytest.raises(BundleError):
            verify(bad)


def test_trailing_data_and_foreign_files_are_refused(tmp_path: Path) -> None:
    data = write(tmp_path / "full.kcb")
    path = tmp_path / "x.kcb"
    path.write_bytes(data + b"\0")
    with pytest.raises(BundleError, match="after its trailer"):
        verify(path)
    path.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(BundleError, match="not a kernelcache bundle"):
        verify(path)
    path.write_bytes(data[:8] + struct.pack("<H", 99) + data[10:])
    with pytest.raises(BundleError, match="version 99"):
        verify(path)


def test_huge_length_field_fails_fast(tmp_path: Path) -> None:
    data = bytearray(write(tmp_path / "full.kcb"))
    data[17:25] = struct.pack("<Q", 2**62)  # the first record's length
    path = tmp_path / "x.kcb"
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="truncated inside record 0"):
        verify(path)


def test_a_record_that_is_not_an_entry_is_refused(tmp_path: Path) -> None:
    # A well-formed bundle (right checksum) around bytes that are no entry.
    import xxhash

    body = struct.pack("<8sHHI", b"KCBUNDLE", 1, 0, 0) + b"E" + struct.pack("<Q", 5) + b"hello"
    body += b"T" + struct.pack("<Q", 1)
    path = tmp_path / "x.kcb"
    path.write_bytes(body + xxhash.xxh3_128_digest(body))
    with pytest.raises(BundleError, match="record 0 is not a valid entry"):
        verify(path)
