"""Signed entries and damaged values: rejected, counted, never returned."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import redis
import zstandard

from kernelcache import Cache, Entry
from kernelcache.errors import CorruptEntry
from kernelcache.stores.redis import RedisStore
from kernelcache.stores.redis import format as fmt
from redis_server import RedisServer, unique_namespace

SECRET = "correct horse battery staple"


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def make(redis_server: RedisServer) -> Callable[..., RedisStore]:
    namespace = unique_namespace()

    def make(**options: object) -> RedisStore:
        return RedisStore(redis_server.url, namespace=namespace, **options)  # type: ignore[arg-type]

    return make


def _entry(size: int = 3000) -> Entry:
    return Entry({"kernel.cubin": b"\x7fELF" + os.urandom(size)}, meta={"arch": "sm_90"})


def _name(store: RedisStore, key: str) -> str:
    return f"kc:{store.namespace}:e:{key}"


def test_signed_round_trip_and_unsigned_readers_still_verify(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    signer = make(secret=SECRET)
    entry = _entry()
    signer.put("k", entry)
    value = raw.get(_name(signer, "k"))
    assert value is not None and value[4] & fmt.SIGNED
    assert signer.get("k") == entry
    assert make().get("k") == entry  # no secret: checksums still guard integrity


@pytest.mark.parametrize(
    "writer_secret",
    [pytest.param(None, id="unsigned"), pytest.param("wrong secret", id="wrong-secret")],
)
def test_values_without_a_valid_signature_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis, writer_secret: str | None
) -> None:
    forger = make(secret=writer_secret)
    planted = _entry()
    forger.put("k", planted)  # a well-formed entry, written by someone without the secret
    reader = make(secret=SECRET)
    assert Cache([reader]).get("k") is None
    assert reader.stats()["forged"] == 1 and reader.counters.hits == 0
    assert raw.exists(_name(reader, "k")) == 1  # not deleted: it may be a peer with another secret


def test_tampered_and_replayed_signed_values_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(secret=SECRET, compress_min=1 << 30)
    store.put("good", _entry())
    value = bytearray(raw.get(_name(store, "good")) or b"")
    value[-10] ^= 0x01  # one bit of the cubin
    raw.set(_name(store, "tampered"), bytes(value))
    raw.copy(_name(store, "good"), _name(store, "replayed"))  # a valid value under another key
    assert store.get("tampered") is None and store.get("replayed") is None
    assert store.stats()["forged"] == 2
    assert store.get("good") is not None


def test_swapped_chunks_of_a_signed_entry_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(secret=SECRET, chunk_size=1024, compress_min=1 << 30)
    store.put("k", _entry(5000))
    chunk = sorted(raw.scan_iter(f"kc:{store.namespace}:c:k:*"))[1]
    raw.set(chunk, os.urandom(1024), keepttl=True)
    assert store.get("k") is None
    assert store.counters.corrupt == 1


def _damage(value: bytes) -> dict[str, bytes]:
    flipped = bytearray(value)
    flipped[-1] ^= 0x40
    header = bytearray(value)
    header[fmt.HEAD_SIZE + 12] ^= 0x01  # inside the entry's header
    return {
        "garbage": b"not a kernelcache value at all",
        "empty": b"",
        "truncated": value[: len(value) // 2],
        "artifact-bit-flip": bytes(flipped),
        "header-bit-flip": bytes(header),
        "size-lie": value[:5] + (len(value) * 2).to_bytes(8, "little") + value[13:],
    }


def test_corrupted_values_are_rejected_counted_and_removed(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(compress_min=1 << 30)
    store.put("good", _entry())
    value = raw.get(_name(store, "good"))
    assert value is not None
    damaged = _damage(value)
    for key, bad in damaged.items():
        raw.set(_name(store, key), bad)
    cache = Cache([store])
    for key in damaged:
        assert cache.get(key) is None, key
    assert store.counters.corrupt == len(damaged)
    assert all(raw.exists(_name(store, key)) == 0 for key in damaged)
    assert cache.get("good") is not None


def test_compressed_values_that_lie_about_their_size_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(max_entry_size=1 << 20)
    packed = _entry().pack("k")
    frame = zstandard.ZstdCompressor().compress(packed)
    name = _name(store, "k").encode()
    lies = {
        "bomb": fmt.seal(name, fmt.ZSTD, 1 << 40, frame, None),  # would allocate 1 TiB
        "short": fmt.seal(name, fmt.ZSTD, len(packed) - 1, frame, None),
        "no-frame": fmt.seal(name, fmt.ZSTD, len(packed), packed, None),
    }
    for key, value in lies.items():
        raw.set(_name(store, key), value)
        assert store.get(key) is None, key
    assert store.counters.corrupt == len(lies)


def test_manifest_format_round_trips_and_rejects_junk() -> None:
    manifest = fmt.Manifest("ab" * 16, 3, 9000, "cd" * 16)
    assert fmt.Manifest.decode(manifest.encode()) == manifest
    for junk in (b"", b"ab:1:2:cd", b"x" * 32 + b":1:2:" + b"c" * 32, manifest.encode() + b"\n"):
        with pytest.raises(CorruptEntry):
            fmt.Manifest.decode(junk)
