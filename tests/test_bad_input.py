"""Bad input on disk and in calls: a counted miss or a clear error, never a crash or a hang
(issue 10)."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
from pathlib import Path

import pytest
import xxhash

from kernelcache import Cache, ConfigError, DiskStore, Entry, MemoryStore, Settings, StoreError
from kernelcache.bundle import BundleError, import_bundle
from kernelcache.entry_format import MAX_ARTIFACTS, header_size
from kernelcache.stores.sqlite import SQLiteStore

KEY = "k" * 32
HUGE = 100 << 30


def forge_huge_entry(path: Path) -> None:
    """An entry whose header (valid checksum) claims a 100 GiB artifact, over a sparse file."""
    packed = Entry({"kernel.cubin": b"x" * 100}).pack(KEY)
    end = header_size(packed)
    forged = bytearray(packed[: end - 16])
    at = forged.index(b"kernel.cubin") + len(b"kernel.cubin")
    forged[at : at + 8] = struct.pack("<Q", HUGE)
    header = bytes(forged)
    path.write_bytes(header + xxhash.xxh3_128_digest(header))
    os.truncate(path, len(header) + 16 + HUGE)  # a hole: st_size matches the claim


def test_a_huge_artifact_over_a_sparse_file_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.pack_max = 0  # an entry file beside the forged one (small ones are packed)
    store.put("other", Entry({"a": b"1"}))
    (entry_file,) = Path(store.path).glob("v1/entries/*/other.kce")
    path = entry_file.parent.parent / store_shard(KEY) / f"{KEY}.kce"
    path.parent.mkdir(exist_ok=True)
    forge_huge_entry(path)
    assert store.get(KEY) is None  # no MemoryError, no 100 GiB read of zeros
    assert store.counters.corrupt == 1


def store_shard(key: str) -> str:
    from kernelcache.stores.disk import shard_of

    return shard_of(key)


def test_a_bundle_record_claiming_huge_sizes_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "b.kcb"
    head = struct.pack("<8sHHI", b"KCBUNDLE", 1, 0, 0) + b"E" + struct.pack("<Q", HUGE)
    path.write_bytes(head + b"\0" * 4096)
    os.truncate(path, len(head) + HUGE + 25)  # sparse: the length "fits" the file
    with open(path, "rb") as f, pytest.raises(BundleError, match="sparse"):
        import_bundle(f, DiskStore(tmp_path / "c"))
    read, write = os.pipe()  # from a pipe, a capped target refuses it before reading

    def feed() -> None:
        os.write(write, head)
        os.close(write)

    threading.Thread(target=feed, daemon=True).start()
    with os.fdopen(read, "rb") as f, pytest.raises(BundleError, match="refused before reading"):
        import_bundle(f, DiskStore(tmp_path / "c", max_bytes=1 << 30))


def test_entry_refuses_more_artifacts_than_the_format_holds() -> None:
    artifacts = {f"a{i}": b"" for i in range(MAX_ARTIFACTS + 1)}
    with pytest.raises(ValueError, match="at most 65535 artifacts"):
        Entry(artifacts)


@pytest.mark.parametrize("name", ["\udc80.cubin", "k\ud800", "\udfff"])
def test_entry_refuses_names_no_file_can_have(name: str) -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        Entry({name: b"x"})


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(os.urandom(200)), id="garbage"),
        pytest.param(lambda p: p.write_text("[" * 100_000 + "]" * 100_000), id="deep-nesting"),
        pytest.param(lambda p: (p.unlink(), p.mkdir(), (p / "x").mkdir()), id="directory"),
        pytest.param(lambda p: (p.unlink(), p.symlink_to("/dev/zero")), id="link"),
    ],
)
@pytest.mark.parametrize("which", ["totals", "keys"])
def test_a_damaged_stats_file_never_fails_the_cache(
    tmp_path: Path, damage: object, which: str
) -> None:
    root = tmp_path / "c"
    with Cache([MemoryStore(), DiskStore(root)]) as cache:
        cache.put(KEY, Entry({"a": b"1"}))
        DiskStore(root).get(KEY)
        cache.get(KEY)
        cache.tiers[0].clear()
        cache.get(KEY)  # a disk hit: per-key statistics too
        cache.flush_stats()
    stats = root / "v1" / "stats"
    targets = [stats / "totals.json"] if which == "totals" else list(stats.glob("keys/*.json"))
    assert targets
    for path in targets:
        damage(path)  # type: ignore[operator]
    cache = Cache([MemoryStore(), DiskStore(root)])
    assert cache.get(KEY) is not None
    cache.put("j" * 32, Entry({"a": b"2"}))
    cache.tiers[0].clear()
    cache.get("j" * 32)
    cache.flush_stats()
    cache.close()
    assert cache.flush_errors == 0  # and counting went on


def _hold(path: str, ready: object, release: object) -> None:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()  # type: ignore[attr-defined]
    release.wait(120)  # type: ignore[attr-defined]


def test_sqlite_lock_file_wait_honours_the_timeout(tmp_path: Path) -> None:
    """Another process holds the database's lock file (a hung open): the timeout applies."""
    path = tmp_path / "cache.sqlite"
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(f"{path}.lock", ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        outcome: list[object] = []

        def open_store() -> None:
            try:
                outcome.append(SQLiteStore(path, timeout=0.2))
            except StoreError as exc:
                outcome.append(exc)

        opener = threading.Thread(target=open_store, daemon=True)
        opener.start()
        opener.join(60)  # far beyond the timeout: a hang shows as no outcome
        assert outcome, "the opener hung: no outcome"
        assert isinstance(outcome[0], StoreError), outcome
        assert "held by another process" in str(outcome[0])
    finally:
        release.set()
        holder.join(30)


def test_a_locked_sqlite_tier_never_fails_cache_construction(tmp_path: Path) -> None:
    """KERNELCACHE_LOCAL=sqlite with its lock file held: Cache() works, the tier is a
    counted miss while locked, and serves again once the lock is gone."""
    settings = Settings.load(dir=str(tmp_path), local="sqlite")
    lock = tmp_path / "cache.sqlite.lock"
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(lock), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("kernelcache.stores.sqlite.file.DEFAULT_TIMEOUT", 0.2)
            cache = Cache(settings=settings)
            sqlite = cache.tiers[1]
            assert cache.get(KEY) is None
            assert sqlite.counters.errors >= 1
    finally:
        release.set()
        holder.join(30)
    cache.put(KEY, Entry({"a": b"1"}))
    assert sqlite.get(KEY) is not None
    cache.close()


def test_a_memory_hit_hands_out_its_own_meta(tmp_path: Path) -> None:
    cache = Cache([MemoryStore()], persist_stats=False)
    cache.put(KEY, Entry({"a": b"1"}, meta={"name": "add", "opts": [1]}))
    first = cache.get(KEY)
    assert first is not None
    first.meta["name"] = "changed"
    first.meta["opts"].append(2)
    meta = first.meta
    meta["name"] = "changed"
    again = cache.get(KEY)
    assert again is not None
    assert again.meta == {"name": "add", "opts": [1]}
    assert first.meta == {"name": "add", "opts": [1]}


@pytest.mark.parametrize("text", ["0", "0K", "0M", "0.0G", " 0 ", "0GiB"])
def test_a_zero_cap_in_any_unit_is_unlimited(text: str) -> None:
    assert Settings.load(environ={"KERNELCACHE_MAX_SIZE": text}).max_bytes is None
    assert Settings.load(environ={}, max_bytes=text).max_bytes is None


@pytest.mark.parametrize("text", ["9" * 400, "99999999999T", "1e9", "5X", "-1", "1..5G"])
def test_a_bad_size_names_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match="KERNELCACHE_MAX_SIZE"):
        Settings.load(environ={"KERNELCACHE_MAX_SIZE": text})
    with pytest.raises(ConfigError, match="KERNELCACHE_MEMORY_MAX_SIZE"):
        Settings.load(environ={"KERNELCACHE_MEMORY_MAX_SIZE": text})


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_cache_dir_variable_is_unset(text: str, tmp_path: Path) -> None:
    default = Settings.load(environ={}).dir
    settings = Settings.load(environ={"KERNELCACHE_DIR": text})
    assert settings.dir == default
    assert settings.sources["dir"] == "default"
