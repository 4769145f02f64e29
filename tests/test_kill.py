"""Writers killed with SIGKILL at random moments in the middle of puts.

A reader process runs the whole time and must never get a partial or wrong
entry. Afterwards the store reopens, works, and every entry in it verifies.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import store_workers
from kernelcache.stores import disk
from kernelcache.stores.disk import DiskStore
from store_workers import KILL_KEYS, OPENERS, check_value, make_value, open_store

ROUNDS = 6
OPTIONS: dict[str, Any] = {
    "max_bytes": 4 << 20
}  # ten keys of up to 1 MiB: writers are killed mid-eviction too
#: Tiers whose usage() stays exact across a crash (a transaction); DiskStore's
#: counter may be left high by a writer killed mid-change, never low.
EXACT_AFTER_CRASH = {"disk": False, "sqlite": True}


def wait_for(path: Path, proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.is_alive(), f"writer exited early with {proc.exitcode}"
        assert time.monotonic() < deadline, "writer did not start"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(kind, id=kind) for kind in sorted(OPENERS)])
def test_writers_killed_mid_put(tmp_path: Path, kind: str) -> None:
    assert set(EXACT_AFTER_CRASH) == set(OPENERS), "say whether the new tier survives crashes"
    path = str(tmp_path / "store")
    options = json.dumps(OPTIONS)
    with open_store(kind, path, **OPTIONS) as store:  # something to read from the start
        for key in KILL_KEYS[:3]:
            store.put(key, make_value(key, -1, 0, os.urandom(100_000)))
    ctx = multiprocessing.get_context("spawn")
    stop, reader_result = tmp_path / "stop", tmp_path / "reader.json"
    reader = ctx.Process(
        target=store_workers.kill_reader, args=(kind, path, options, str(stop), str(reader_result))
    )
    rng = random.Random(1234)
    writers = []
    try:
        reader.start()
        for round_ in range(ROUNDS):
            ready = tmp_path / f"ready{round_}"
            writer = ctx.Process(
                target=store_workers.kill_writer, args=(kind, path, options, str(ready), round_)
            )
            writers.append(writer)
            writer.start()
            wait_for(ready, writer, timeout=60)
            time.sleep(rng.uniform(0.05, 0.4))  # some puts done, one in progress
            writer.kill()
            writer.join()
            assert writer.exitcode == -signal.SIGKILL
        stop.touch()
        reader.join(timeout=60)
    finally:
        for proc in [reader, *writers]:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert reader.exitcode == 0
    result = json.loads(reader_result.read_text())
    assert result["bad"] == []
    assert result["store_errors"] == []
    assert result["counters"]["corrupt"] == 0
    assert result["hits"] > 0

    with open_store(kind, path, **OPTIONS) as store:
        infos = list(store.scan())
        assert infos, "the writers' entries are gone"
        for info in infos:  # verify every entry, as `kernelcache verify` would
            entry = store.get(info.key)
            assert entry is not None, info.key
            assert check_value(info.key, entry) is None
        assert store.counters.corrupt == 0
        actual = (len(infos), sum(info.size for info in infos))
        if EXACT_AFTER_CRASH[kind]:
            assert store.usage() == actual
        else:  # high, never low: a crash cannot let the tier outgrow its cap
            assert isinstance(store, DiskStore)
            counted = store.usage()
            assert counted[0] >= actual[0], (counted, actual)
            assert counted[1] >= actual[1], (counted, actual)
            assert store.recount() == actual
        store.put("after", make_value("after", 0, 0, b"works"))
        got = store.get("after")
        assert got is not None
        assert check_value("after", got) is None
    if kind == "disk":
        check_disk_staging_after_kills(path)


def check_disk_staging_after_kills(path: str) -> None:
    """Files killed writers left in staging (the reads above ignored them) are kept
    while they could belong to a live writer, and swept on open once stale."""
    store = DiskStore(path, **OPTIONS)
    leftovers = os.listdir(store.layout.staging)  # often one .tmp of the writer killed in write
    stale = time.time() - 2 * disk.STALE_STAGING_SECONDS
    for name in leftovers:
        os.utime(os.path.join(store.layout.staging, name), (stale, stale))
    store.close()
    DiskStore(path, **OPTIONS).close()
    assert os.listdir(store.layout.staging) == []
