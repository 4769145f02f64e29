"""The entry format: exact round trips, and every defect is CorruptEntry, never wrong bytes."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernelcache.entry import Entry
from kernelcache.entry_format import MAGIC
from kernelcache.errors import CorruptEntry

names = st.text(
    alphabet=st.characters(exclude_characters="/\\\0", exclude_categories=["Cs"]),
    min_size=1,
    max_size=40,
).filter(lambda n: n not in (".", ".."))
artifacts = st.dictionaries(names, st.binary(max_size=2048), max_size=5)
json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
metas = st.dictionaries(
    st.text(max_size=10), json_scalars | st.lists(json_scalars, max_size=3), max_size=4
)


@given(artifacts, metas, st.text(alphabet="0123456789abcdef", min_size=0, max_size=64))
def test_round_trip(arts: dict[str, bytes], meta: dict[str, Any], key: str) -> None:
    entry = Entry(arts, meta)
    packed = entry.pack(key)
    back = Entry.unpack(packed, key)
    assert back == entry
    assert dict(back) == arts
    assert back.meta == meta
    assert back.key == key
    assert back.names == list(arts)


SAMPLE = Entry(
    {"kernel.cubin": bytes(range(256)) * 8, "meta.json": b'{"a": 1}'}, {"name": "add"}
).pack("k1")


@given(st.integers(0, len(SAMPLE) - 1))
def test_every_truncation_is_corrupt(cut: int) -> None:
    with pytest.raises(CorruptEntry):
        Entry.unpack(SAMPLE[:cut])


@given(st.integers(0, len(SAMPLE) * 8 - 1))
def test_every_single_bit_flip_is_corrupt(bit: int) -> None:
    data = bytearray(SAMPLE)
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        Entry.unpack(bytes(data))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096) | st.binary(max_size=64).map(lambda b: MAGIC + b))
def test_foreign_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptEntry):
        Entry.unpack(data)


@given(st.binary(min_size=1, max_size=64))
def test_trailing_garbage_is_corrupt(extra: bytes) -> None:
    with pytest.raises(CorruptEntry):
        Entry.unpack(SAMPLE + extra)


def test_key_mismatch_is_corrupt() -> None:
    with pytest.raises(CorruptEntry, match="stored for key"):
        Entry.unpack(SAMPLE, "another-key")
    assert Entry.unpack(SAMPLE, "k1")["meta.json"] == b'{"a": 1}'


def test_pickle_is_never_involved() -> None:
    with pytest.raises(CorruptEntry):
        Entry.unpack(pickle.dumps({"kernel.cubin": b"x"}))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param(".", id="dot"),
        pytest.param("..", id="dotdot"),
        pytest.param("a/b", id="slash"),
        pytest.param("../etc/passwd", id="traversal"),
        pytest.param("a\\b", id="backslash"),
        pytest.param("a\0b", id="nul"),
        pytest.param("x" * 256, id="too-long"),
        pytest.param("é" * 128, id="too-long-in-bytes"),
        pytest.param(7, id="not-str"),
    ],
)
def test_unsafe_artifact_names_are_refused(name: Any) -> None:
    with pytest.raises(ValueError, match="artifact name"):
        Entry({name: b"x"})


def test_bad_values_and_meta() -> None:
    with pytest.raises(TypeError, match="must be bytes"):
        Entry({"a": "text"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="JSON"):
        Entry({"a": b""}, {"x": object()})
    with pytest.raises(TypeError, match="JSON"):
        Entry({"a": b""}, {"x": float("nan")})
    with pytest.raises(TypeError, match="mapping"):
        Entry([("a", b"")])  # type: ignore[arg-type]


def test_longest_safe_name_round_trips() -> None:
    name = "x" * 255
    assert Entry.unpack(Entry({name: b"1"}).pack())[name] == b"1"


def test_missing_artifact_error_names_it() -> None:
    with pytest.raises(KeyError, match=r"kernel\.ptx"):
        Entry({"kernel.cubin": b""})["kernel.ptx"]


def test_path_of_memory_only_entry_is_a_private_real_file() -> None:
    entry = Entry({"kernel.cubin": b"\x7fELF" + b"1" * 100})
    path = entry.path("kernel.cubin")
    with open(path, "rb") as f:
        assert f.read() == entry["kernel.cubin"]
    assert os.path.basename(path) == "kernel.cubin"
    assert entry.path("kernel.cubin") == path
    assert os.stat(os.path.dirname(os.path.dirname(path))).st_mode & 0o077 == 0


def test_a_cut_private_copy_is_rewritten_not_handed_out() -> None:
    data = b"\x7fELF" + b"9" * 300
    path = Entry({"kernel.cubin": data}).path("kernel.cubin")
    with open(path, "r+b") as f:
        f.truncate(10)  # damaged by something outside this process
    again = Entry({"kernel.cubin": data}).path("kernel.cubin")
    assert again == path
    with open(again, "rb") as f:
        assert f.read() == data
