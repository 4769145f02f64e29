"""The contract every storage tier keeps, as pytest tests a tier's test module inherits.

A tier, built in or third-party, proves it keeps the contract by subclassing
:class:`StoreContract` in its tests and giving it a ``store_factory``
fixture (as fsspec ships its abstract filesystem tests)::

    import pytest
    from kernelcache.testing import StoreContract

    class TestMyStore(StoreContract):
        persistent = True   # a new store object on the same place sees earlier entries
        capped = True       # max_bytes / max_entries are honoured

        @pytest.fixture
        def store_factory(self, tmp_path):
            made = []
            def make(**options):  # read_only=, max_bytes=, max_entries=
                made.append(MyStore(tmp_path / "db", **options))
                return made[-1]
            yield make
            for store in made:
                store.close()

A tier that refreshes its LRU clock at most every so often overrides the
``touch_every_hit`` fixture to refresh it on every hit. Needs pytest.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import pytest

from kernelcache.entry import Entry
from kernelcache.errors import ReadOnlyStoreError, StoreError
from kernelcache.stores.base import Store

__all__ = ["ARTIFACTS", "BAD_KEYS", "StoreContract", "StoreFactory", "make_entry"]

#: ``make(read_only=False, max_bytes=None, max_entries=None) -> Store``: a new store
#: object on the same place (directory, database, namespace) each call.
StoreFactory = Callable[..., Store]

# An artifact holding every byte value, an empty one and a larger one with no pattern.
ARTIFACTS = {
    "kernel.cubin": bytes(range(256)) * 64,
    "empty": b"",
    "blob.bin": os.urandom(300_000),
}

BAD_KEYS = [
    pytest.param("", id="empty"),
    pytest.param("a/b", id="slash"),
    pytest.param("../escape", id="dotdot"),
    pytest.param(".hidden", id="leading-dot"),
    pytest.param("-flag", id="leading-dash"),
    pytest.param("sp ace", id="space"),
    pytest.param("nul\0", id="nul"),
    pytest.param("k" * 201, id="too-long"),
    pytest.param("ключ", id="non-ascii"),
    pytest.param(123, id="int"),
    pytest.param(None, id="none"),
    pytest.param(b"bytes", id="bytes"),
]


def make_entry(tag: str, size: int = 1000) -> Entry:
    return Entry({"data": tag.encode().ljust(size, b".")}, meta={"tag": tag})


def tick() -> None:
    """Let the clock move past file-system timestamp granularity (a few ms on Linux)."""
    time.sleep(0.02)


class StoreContract:
    """Tests every :class:`~kernelcache.stores.base.Store` must pass (see the module docstring)."""

    #: Entries outlive the store object (a new one on the same place sees them).
    persistent = True
    #: ``max_bytes`` and ``max_entries`` are honoured.
    capped = True

    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        raise NotImplementedError("a StoreContract subclass provides the store_factory fixture")

    @pytest.fixture
    def store(self, store_factory: StoreFactory) -> Store:
        return store_factory()

    @pytest.fixture
    def touch_every_hit(self) -> None:
        """Make every hit refresh the tier's LRU clock (tiers that rate-limit it override this)."""

    def need_caps(self) -> None:
        if not self.capped:
            pytest.skip("this tier has no per-store size caps")

    def test_round_trip_is_byte_for_byte(self, store: Store) -> None:
        store.put("k1", Entry(ARTIFACTS, meta={"name": "add", "n": [1, 2.5, None]}))
        got = store.get("k1")
        assert got is not None
        assert got.names == list(ARTIFACTS)
        for name, data in ARTIFACTS.items():
            assert got[name] == data
        assert got.meta == {"name": "add", "n": [1, 2.5, None]}

    def test_entry_path_is_a_real_file_with_the_bytes(self, store: Store) -> None:
        store.put("k1", Entry(ARTIFACTS))
        got = store.get("k1")
        assert got is not None
        for name, data in ARTIFACTS.items():
            with open(got.path(name), "rb") as f:
                assert f.read() == data

    def test_miss_is_none(self, store: Store) -> None:
        assert store.get("absent") is None
        assert store.counters.misses == 1
        assert store.counters.hits == 0

    def test_same_entry_under_two_keys(self, store: Store) -> None:
        entry = make_entry("shared")
        store.put("a", entry)
        store.put("b", entry)
        assert store.get("a") == entry
        assert store.get("b") == entry
        assert sorted(store.keys()) == ["a", "b"]

    def test_overwrite_replaces(self, store: Store) -> None:
        store.put("k", make_entry("old", 5000))
        store.put("k", make_entry("new", 100))
        got = store.get("k")
        assert got is not None
        assert got.meta == {"tag": "new"}
        assert list(store.keys()) == ["k"]
        count, size = store.usage()
        assert count == 1
        assert size < 5000  # the old entry's bytes are no longer counted

    def test_delete(self, store: Store) -> None:
        store.put("k", make_entry("x"))
        store.put("other", make_entry("y"))
        assert store.delete("k") is True
        assert store.get("k") is None
        assert store.delete("k") is False
        assert store.get("other") == make_entry("y")
        assert store.counters.deletes == 1
        assert store.usage()[0] == 1

    def test_keys_scan_and_usage_agree(self, store: Store) -> None:
        entries = {f"key{i}": make_entry(str(i), 500 + 100 * i) for i in range(10)}
        for key, entry in entries.items():
            store.put(key, entry)
        assert sorted(store.keys()) == sorted(entries)
        infos = {info.key: info for info in store.scan()}
        assert sorted(infos) == sorted(entries)
        for key, info in infos.items():
            assert info.size >= entries[key].nbytes  # packed tiers add their header
        assert store.usage() == (10, sum(info.size for info in infos.values()))

    def test_clear(self, store: Store) -> None:
        for i in range(5):
            store.put(f"k{i}", make_entry(str(i)))
        assert store.clear() == 5
        assert list(store.keys()) == []
        assert store.usage() == (0, 0)
        store.put("again", make_entry("again"))  # still usable
        assert store.get("again") == make_entry("again")

    def test_read_only_refuses_writes_and_keeps_data(self, store: Store) -> None:
        store.put("k", make_entry("kept"))
        store.read_only = True
        with pytest.raises(ReadOnlyStoreError):
            store.put("k", make_entry("replaced"))
        with pytest.raises(ReadOnlyStoreError):
            store.put("new", make_entry("new"))
        with pytest.raises(ReadOnlyStoreError):
            store.delete("k")
        with pytest.raises(ReadOnlyStoreError):
            store.clear()
        assert issubclass(ReadOnlyStoreError, StoreError)  # the Cache treats it as a tier failure
        assert store.get("k") == make_entry("kept")
        assert list(store.keys()) == ["k"]

    def test_reopened_read_only_sees_data(self, store_factory: StoreFactory) -> None:
        if not self.persistent:
            pytest.skip("this tier is not persistent")
        writer = store_factory()
        writer.put("k", make_entry("kept"))
        writer.close()
        reader = store_factory(read_only=True)
        assert reader.get("k") == make_entry("kept")
        with pytest.raises(ReadOnlyStoreError):
            reader.put("k", make_entry("other"))
        assert store_factory().get("k") == make_entry("kept")

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_raise_value_error(self, store: Store, key: object) -> None:
        with pytest.raises(ValueError, match="invalid cache key"):
            store.put(key, make_entry("x"))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="invalid cache key"):
            store.delete(key)  # type: ignore[arg-type]
        # get may skip validation on a hot path (memory), but never finds anything.
        with contextlib.suppress(ValueError):
            assert store.get(key) is None  # type: ignore[arg-type]
        assert list(store.keys()) == []

    def test_valid_key_forms(self, store: Store) -> None:
        for key in ("a", "A_b-c.d", "0" * 64, "k" * 200, "_x", "a.b"):
            store.put(key, make_entry(key))
        for key in ("a", "A_b-c.d", "0" * 64, "k" * 200, "_x", "a.b"):
            assert store.get(key) == make_entry(key)

    @pytest.mark.parametrize(
        "caps",
        [
            pytest.param({"max_entries": 48}, id="max_entries"),
            pytest.param({"max_bytes": 48 * 1200}, id="max_bytes"),
        ],
    )
    def test_lru_evicts_least_recently_used(
        self, store_factory: StoreFactory, caps: dict[str, int], touch_every_hit: None
    ) -> None:
        """k0 is read after k1 and k2 were put, so k1 goes first (a tier may evict
        several at once, down to a low-water mark, but never k0 before k1)."""
        self.need_caps()
        store = store_factory(**caps)
        k0, k1, k2 = "lru00000", "lru00001", "lru00002"
        for key in (k0, k1, k2):
            store.put(key, make_entry(key))
            tick()
        assert store.get(k0) is not None
        tick()
        latest = k2
        puts = 3
        while store.counters.evictions == 0:
            latest = f"lru{puts:05d}"
            store.put(latest, make_entry(latest))
            puts += 1
            assert puts < 200, "no eviction under the cap"
        assert store.get(k1) is None
        assert store.get(k0) == make_entry(k0)
        assert store.get(latest) == make_entry(latest)
        assert store.usage()[0] == puts - store.counters.evictions

    @pytest.mark.parametrize(
        "caps",
        [
            pytest.param({"max_entries": 32}, id="max_entries"),
            pytest.param({"max_bytes": 16 * 4096}, id="max_bytes"),
        ],
    )
    def test_caps_hold_after_every_put(
        self, store_factory: StoreFactory, caps: dict[str, int]
    ) -> None:
        """One writer, so no concurrent slack: the cap holds whenever put returns."""
        self.need_caps()
        store = store_factory(**caps)
        for i in range(150):
            store.put(f"key{i:03d}", make_entry(str(i), 900 + (i * 37) % 400))
            count, size = store.usage()
            assert count <= caps.get("max_entries", count)
            assert size <= caps.get("max_bytes", size)
            assert sum(info.size for info in store.scan()) == size
        assert store.counters.evictions == 150 - store.usage()[0] > 0
        assert store.get("key149") is not None  # the newest entry is kept

    def test_entry_larger_than_the_cap_is_not_kept(self, store_factory: StoreFactory) -> None:
        self.need_caps()
        store = store_factory(max_bytes=16 * 1024)
        store.put("big", make_entry("big", 20_000))
        assert store.get("big") is None
        assert store.usage() == (0, 0)
        assert store.counters.evictions >= 1

    def test_counters_move(self, store: Store) -> None:
        entry = make_entry("x", 2000)
        store.put("k", entry)
        assert store.counters.puts == 1
        assert store.counters.bytes_written >= entry.nbytes
        assert store.get("k") == entry
        assert store.get("absent") is None
        assert store.delete("k") is True
        counters = store.counters
        assert (counters.hits, counters.misses, counters.deletes) == (1, 1, 1)
        assert counters.bytes_read >= entry.nbytes
        assert (counters.errors, counters.corrupt, counters.evictions) == (0, 0, 0)
        stats = store.stats()
        assert stats["kind"] == store.kind
        assert stats["read_only"] is False
        assert stats["hits"] == 1
        assert stats["puts"] == 1

    def test_context_manager_closes(self, store_factory: StoreFactory) -> None:
        with store_factory() as store:
            store.put("k", make_entry("x"))
            assert store.get("k") == make_entry("x")
        assert store.closed
        if self.persistent:
            with store_factory() as reopened:
                assert reopened.get("k") == make_entry("x")

    def test_threads_share_one_store(self, store: Store) -> None:
        """Four threads mixing puts, gets and deletes on a few keys: no error, no wrong value."""
        errors: list[BaseException] = []
        keys = [f"t{i}" for i in range(6)]

        def work(seed: int) -> None:
            try:
                for i in range(150):
                    key = keys[(seed * 7 + i) % len(keys)]
                    if i % 5 == 4:
                        store.delete(key)
                    elif i % 2:
                        store.put(key, make_entry(key, 500 + i))
                    else:
                        got = store.get(key)
                        assert got is None or got.meta == {"tag": key}
                        assert got is None or got["data"].startswith(key.encode())
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert store.counters.errors == 0
        count, size = store.usage()
        assert count == len(list(store.keys()))
        assert size == sum(info.size for info in store.scan())
