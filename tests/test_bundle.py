"""The bundle format: round trip, and every truncation or alteration refused."""

from __future__ import annotations

import errno
import io
import os
import struct
import threading
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from kernelcache import Cache, DiskStore, Entry, MemoryStore, StoreError
from kernelcache.bundle import BundleError, BundleWriter, entries, import_bundle, verify

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


# Importing: one read, all or nothing --------------------------------------
def bundle_bytes(items: dict[str, Entry]) -> bytes:
    buffer = io.BytesIO()
    writer = BundleWriter(buffer)
    for key, entry in items.items():
        writer.add(entry, key)
    writer.finish()
    return buffer.getvalue()


def piped(data: bytes) -> BinaryIO:
    """``data`` arriving through a pipe (a writer thread), as from ``curl ... |``."""
    read, write = os.pipe()

    def feed() -> None:
        with os.fdopen(write, "wb") as f:
            f.write(data)

    threading.Thread(target=feed, daemon=True).start()
    return os.fdopen(read, "rb")


BIG = {f"key{i:02d}": Entry({"a.cubin": bytes([i]) * 30_000}) for i in range(8)}


def test_import_from_a_pipe_reads_the_bundle_once(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    with piped(bundle_bytes(ENTRIES)) as source:
        result = import_bundle(source, store)
    assert (result.entries, result.added, result.present, result.conflicts) == (3, 3, 0, [])
    assert {k: store.get(k) for k in ENTRIES} == ENTRIES
    with piped(bundle_bytes(ENTRIES)) as source:
        again = import_bundle(source, Cache([MemoryStore(), store]))
    assert (again.added, again.present) == (0, 3)


def test_a_bundle_that_turns_out_bad_half_way_imports_nothing(tmp_path: Path) -> None:
    data = bytearray(bundle_bytes(BIG))
    data[-100] ^= 0x01  # inside the last record: everything before it verifies
    store = DiskStore(tmp_path / "c")
    with piped(bytes(data)) as source, pytest.raises(BundleError):
        import_bundle(source, store)
    assert list(store.keys()) == []


def test_a_key_twice_with_different_contents_is_a_bad_bundle(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    writer = BundleWriter(buffer)
    writer.add(Entry({"a": b"1"}), "k1")
    writer.add(Entry({"a": b"2"}), "k2")
    writer.add(Entry({"a": b"3"}), "k1")
    writer.finish()
    store = DiskStore(tmp_path / "c")
    with pytest.raises(BundleError, match="k1 appears twice with different contents"):
        import_bundle(io.BytesIO(buffer.getvalue()), store)
    assert list(store.keys()) == []


def test_keys_stored_with_other_contents_are_kept_and_reported(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    mine = Entry({"x": b"mine"})
    store.put("k1", mine)
    result = import_bundle(io.BytesIO(bundle_bytes(ENTRIES)), store)
    assert result.conflicts == ["k1"]
    assert result.added == 2
    assert store.get("k1") == mine


def test_a_disk_that_fills_half_way_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("before", Entry({"x": b"kept"}))
    real_writev = os.writev
    written = [0]

    def fills_up(fd: int, buffers: Any) -> int:
        written[0] += sum(map(len, buffers))
        if written[0] > 100_000:  # the third entry does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers)

    # Entries are written with os.writev (the spool, a buffered file, is not): the
    # bundle is read and spooled whole, then the disk fills while importing.
    monkeypatch.setattr(os, "writev", fills_up)
    with pytest.raises(StoreError):
        import_bundle(io.BytesIO(bundle_bytes(BIG)), store)
    monkeypatch.undo()
    assert sorted(store.keys()) == ["before"]
    assert os.listdir(store.layout.staging) == []


def test_import_keeps_the_target_cap(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", max_bytes=100_000)
    result = import_bundle(io.BytesIO(bundle_bytes(BIG)), store)
    assert result.added == 8
    assert store.usage()[1] <= 100_000
    assert store.counters.evictions >= 5
