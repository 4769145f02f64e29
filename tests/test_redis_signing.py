"""Signed entries and damaged values: rejected, counted, never returned; signed ones never lost."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kernelcache import Cache, Entry, Settings
from kernelcache.errors import ConfigError, CorruptEntry, StoreError
from kernelcache.stores.redis import RedisStore
from kernelcache.stores.redis import format as fmt
from redis_server import LOADED, RedisServer, unique_namespace

SECRET = "correct horse battery staple"
CHUNK = fmt.MIN_CHUNK_SIZE


@pytest.fixture
def make(redis_server: RedisServer) -> Callable[..., RedisStore]:
    namespace = unique_namespace()

    def make(**options: object) -> RedisStore:
        options.setdefault("timeout", LOADED)
        return RedisStore(redis_server.url, namespace=namespace, **options)  # type: ignore[arg-type]

    return make


def _entry(size: int = 3000) -> Entry:
    return Entry({"kernel.cubin": b"\x7fELF" + os.urandom(size)}, meta={"arch": "sm_90"})


def _name(store: RedisStore, key: str) -> str:
    return f"kc:{store.namespace}:e:{{{key}}}"


def _stored(raw: redis.Redis, name: str) -> bytes:
    """The record under ``name`` as Redis holds it."""
    value = raw.get(name)
    assert isinstance(value, bytes)  # present, and the client does not decode responses
    return value


def test_signed_round_trip_inline_and_chunked(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    signer = make(secret=SECRET, chunk_size=CHUNK, compress_min=1 << 30)
    small, big = _entry(), _entry(3 * CHUNK)
    signer.put("small", small)
    signer.put("big", big)
    value = _stored(raw, _name(signer, "small"))
    assert value[-5] & fmt.SIGNED
    assert signer.get("small") == small
    assert signer.get("big") == big
    assert make(secret=SECRET).get("big") == big  # another client with the secret


@pytest.mark.parametrize("chunked", [False, True], ids=["inline", "chunked"])
def test_a_client_without_the_secret_never_deletes_signed_entries(
    make: Callable[..., RedisStore], raw: redis.Redis, chunked: bool
) -> None:
    signer = make(secret=SECRET, chunk_size=CHUNK, compress_min=1 << 30)
    entry = _entry(3 * CHUNK if chunked else 3000)
    signer.put("k", entry)
    before = set(raw.scan_iter(f"kc:{signer.namespace}:*"))
    reader = make(chunk_size=CHUNK)
    assert Cache([reader]).get("k") is None  # it cannot check the signature: unreadable
    assert reader.get("k") is None  # remembered: not even read again
    assert reader.counters.unverifiable == 1
    assert reader.counters.misses == 2
    assert reader.counters.corrupt == 0
    assert reader.counters.hits == 0
    assert set(raw.scan_iter(f"kc:{signer.namespace}:*")) == before  # nothing deleted
    assert raw.pttl(_name(signer, "k")) == -1  # nor set to expire
    assert signer.get("k") == entry


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
    assert reader.get("k") is None  # remembered as bad: the second lookup reads nothing
    assert reader.stats()["forged"] == 1
    assert reader.counters.hits == 0
    assert raw.exists(_name(reader, "k")) == 1  # not deleted: it may be a peer with another secret
    entry = _entry()
    if writer_secret is not None:
        # Signed with another secret: never replaced, by either side (issue 20: two
        # secrets would overwrite each other forever). A person removes it.
        with pytest.raises(StoreError, match="kept the signed entry"):
            reader.put("k", entry)
        assert reader.counters.not_replaced == 1
        raw.delete(_name(reader, "k"))
    reader.put("k", entry)  # its own put clears the memory of the bad value
    assert reader.get("k") == entry


def test_tampered_and_replayed_signed_values_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(secret=SECRET, compress_min=1 << 30)
    store.put("good", _entry())
    value = bytearray(_stored(raw, _name(store, "good")))
    value[100] ^= 0x01  # one bit of the cubin
    raw.set(_name(store, "tampered"), bytes(value))
    raw.copy(_name(store, "good"), _name(store, "replayed"))  # a valid value under another key
    assert store.get("tampered") is None
    assert store.get("replayed") is None
    assert store.stats()["forged"] == 2
    assert store.get("good") is not None


def test_swapped_chunks_of_a_signed_entry_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(secret=SECRET, chunk_size=CHUNK, compress_min=1 << 30)
    store.put("k", _entry(3 * CHUNK))
    chunk = sorted(raw.scan_iter(f"kc:{store.namespace}:c:{{k}}:*"))[1]
    raw.set(chunk, os.urandom(CHUNK), keepttl=True)
    assert store.get("k") is None
    assert store.counters.corrupt == 1


def _damage(value: bytes) -> dict[str, bytes]:
    flipped = bytearray(value)
    flipped[-fmt.TAIL_SIZE - 1] ^= 0x40  # the last byte of the artifact
    header = bytearray(value)
    header[12] ^= 0x01  # inside the entry's header
    size_lie = value[: -fmt.TAIL_SIZE] + (len(value) * 2).to_bytes(8, "little")
    return {
        "garbage": b"not a kernelcache value at all",
        "empty": b"",
        "truncated": value[: len(value) // 2],
        "artifact-bit-flip": bytes(flipped),
        "header-bit-flip": bytes(header),
        "size-lie": size_lie + value[-fmt.TAIL_SIZE + 8 :],
    }


def test_corrupted_values_are_rejected_counted_and_removed(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(compress_min=1 << 30)
    store.put("good", _entry())
    value = _stored(raw, _name(store, "good"))
    damaged = _damage(value)
    for key, bad in damaged.items():
        raw.set(_name(store, key), bad)
    cache = Cache([store])
    for key in damaged:
        assert cache.get(key) is None, key
    assert store.counters.corrupt == len(damaged)
    assert all(raw.exists(_name(store, key)) == 0 for key in damaged)
    assert cache.get("good") is not None


def test_a_read_only_store_remembers_damage_it_may_not_remove(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    reader = make(read_only=True)
    raw.set(_name(reader, "k"), b"garbage")
    raw.config_resetstat()
    assert reader.get("k") is None
    assert reader.get("k") is None
    assert reader.counters.corrupt == 1
    assert reader.counters.misses == 2
    assert raw.info("commandstats")["cmdstat_get"]["calls"] == 1  # the second lookup paid nothing
    assert raw.exists(_name(reader, "k")) == 1


def test_records_of_another_format_version_are_clean_misses(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    store = make(compress_min=1 << 30)
    store.put("k", _entry())
    value = _stored(raw, _name(store, "k"))
    raw.set(_name(store, "k"), value[:-4] + bytes([fmt.VERSION + 1]) + fmt.MAGIC)
    assert store.get("k") is None
    assert store.counters.corrupt == 0
    assert store.counters.misses == 1
    assert raw.exists(_name(store, "k")) == 1  # a newer peer's record is left to it


def test_compressed_values_that_lie_about_their_size_are_rejected(
    make: Callable[..., RedisStore], raw: redis.Redis
) -> None:
    import zstandard

    store = make(max_entry_size=1 << 20)
    packed = _entry().pack("k")
    frame = zstandard.ZstdCompressor().compress(packed)
    name = _name(store, "k").encode()
    lies = {
        "short": fmt.seal(name, fmt.ZSTD, len(packed) - 1, frame, None),
        "no-frame": fmt.seal(name, fmt.ZSTD, len(packed), packed, None),
    }
    for key, value in lies.items():
        raw.set(_name(store, key), value)
        assert store.get(key) is None, key
    assert store.counters.corrupt == len(lies)


def test_empty_secret_is_a_config_error_never_signing_off(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    for secret in ("", "  ", b""):
        with pytest.raises(ConfigError, match="empty"):
            RedisStore(redis_server.url, secret=secret)
    env = {
        "KERNELCACHE_DIR": str(tmp_path / "cache"),
        "KERNELCACHE_REMOTE": f"{redis_server.url}?namespace={unique_namespace()}",
        "KERNELCACHE_SECRET": "",
    }
    with pytest.raises(ConfigError, match="KERNELCACHE_SECRET"):
        Cache(settings=Settings.load(env))


def test_manifest_format_round_trips_and_rejects_junk() -> None:
    manifest = fmt.Manifest("ab" * 16, 3, CHUNK, 3 * CHUNK - 5, "cd" * 16)
    assert fmt.Manifest.decode(manifest.encode()) == manifest
    manifest.check(1 << 30)
    junk = (
        b"",
        b"ab:1:2:cd",
        b"x" * 32 + b":1:65536:2:" + b"c" * 32,
        manifest.encode() + b"\n",
        manifest.encode() + b":7",
    )
    for value in junk:
        with pytest.raises(CorruptEntry):
            fmt.Manifest.decode(value)
    inconsistent = (
        fmt.Manifest("ab" * 16, 4, CHUNK, 3 * CHUNK, "cd" * 16),  # one chunk too many
        fmt.Manifest("ab" * 16, 3, 1024, 3000, "cd" * 16),  # chunks under the minimum size
    )
    for manifest in inconsistent:
        with pytest.raises(CorruptEntry):
            manifest.check(1 << 30)
