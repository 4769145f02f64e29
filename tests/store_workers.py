"""Code the multiprocess store tests run in spawned processes.

Kept out of the test modules so a spawned child imports only this (by name:
pytest puts tests/ on sys.path and spawn passes sys.path on). Arguments are
plain strings and numbers; results come back as JSON files, never pickles.

Every value carries its own check, independent of the entry format's
checksums: the key it was written under and a SHA-256 of the artifact, so a
reader can tell a torn, stale-format or misfiled value from a good one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from kernelcache import Entry, StoreError
from kernelcache.stores import DiskStore, SQLiteStore, Store

#: Persistent tiers the multiprocess tests run over: name -> opener(path, **options).
OPENERS: dict[str, Any] = {"disk": DiskStore, "sqlite": SQLiteStore}
_DIGEST = 32


def open_store(kind: str, path: str, **options: Any) -> Store:
    store: Store = OPENERS[kind](path, **options)
    return store


def make_value(key: str, writer: int, seq: int, body: bytes) -> Entry:
    """An entry whose artifact names its key and writer and ends with its own SHA-256."""
    payload = f"{key}|{writer}|{seq}|".encode() + body
    blob = payload + hashlib.sha256(payload).digest()
    return Entry({"blob": blob}, meta={"key": key, "writer": writer, "seq": seq})


def check_value(key: str, entry: Entry) -> str | None:
    """``None`` if ``entry`` is a whole value written under ``key``, else what is wrong."""
    blob = entry["blob"]
    payload, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(payload).digest() != digest:
        return f"{key}: artifact fails its SHA-256 ({len(blob)} bytes)"
    head = payload.split(b"|", 3)
    meta = entry.meta
    if head[0] != key.encode() or meta.get("key") != key:
        return f"{key}: holds the value of {head[0]!r} / {meta.get('key')!r}"
    if head[1:3] != [str(meta.get("writer")).encode(), str(meta.get("seq")).encode()]:
        return f"{key}: metadata {meta} does not match the artifact {head[1:3]}"
    return None


def stored_bytes(store: Store) -> int:
    """Bytes the entries take now, from the entries themselves (not the tier's counters)."""
    return sum(info.size for info in store.scan())


def stress_worker(
    kind: str, path: str, options_json: str, worker: int, seconds: float, result_path: str
) -> None:
    """Mixed get/put/delete on a small key set; exits 1 if any read was wrong."""
    store = open_store(kind, path, **json.loads(options_json))
    rng = random.Random(worker)
    keys = [f"key{i:02d}" for i in range(48)]
    noise = os.urandom(8192)
    result: dict[str, Any] = {"gets": 0, "hits": 0, "puts": 0, "deletes": 0, "bad": []}
    result.update(store_errors=[], max_stored=0, checks=0)
    deadline = time.monotonic() + seconds
    next_check = 0.0
    seq = 0
    while time.monotonic() < deadline:
        key = rng.choice(keys)
        roll = rng.random()
        try:
            if roll < 0.45:
                result["gets"] += 1
                entry = store.get(key)
                if entry is not None:
                    result["hits"] += 1
                    problem = check_value(key, entry)
                    if problem:
                        result["bad"].append(problem)
            elif roll < 0.85:
                seq += 1
                body = noise[: rng.randint(1000, 6000)]
                store.put(key, make_value(key, worker, seq, body))
                result["puts"] += 1
            else:
                result["deletes"] += store.delete(key)
        except StoreError as exc:
            result["store_errors"].append(str(exc)[:300])
        if time.monotonic() >= next_check:  # the cap, measured while everyone writes
            result["max_stored"] = max(result["max_stored"], stored_bytes(store))
            result["checks"] += 1
            next_check = time.monotonic() + 0.1
    result["counters"] = store.counters.as_dict()
    store.close()
    Path(result_path).write_text(json.dumps(result))
    sys.exit(1 if result["bad"] else 0)


KILL_KEYS = [f"big{i:02d}" for i in range(10)]


def kill_writer(kind: str, path: str, options_json: str, ready_path: str, seed: int) -> None:
    """Put large entries until killed (the test sends SIGKILL at a random moment)."""
    store = open_store(kind, path, **json.loads(options_json))
    rng = random.Random(seed)
    noise = os.urandom(1 << 20)
    Path(ready_path).touch()
    seq = 0
    while True:
        seq += 1
        key = rng.choice(KILL_KEYS)
        store.put(key, make_value(key, seed, seq, noise[: rng.randint(64 << 10, 1 << 20)]))


def kill_reader(kind: str, path: str, options_json: str, stop_path: str, result_path: str) -> None:
    """Read every key over and over until told to stop; exits 1 on any wrong read."""
    store = open_store(kind, path, **json.loads(options_json))
    result: dict[str, Any] = {"gets": 0, "hits": 0, "bad": [], "store_errors": []}
    while not os.path.exists(stop_path):
        for key in KILL_KEYS:
            result["gets"] += 1
            try:
                entry = store.get(key)
            except StoreError as exc:
                result["store_errors"].append(str(exc)[:300])
                continue
            if entry is not None:
                result["hits"] += 1
                problem = check_value(key, entry)
                if problem:
                    result["bad"].append(problem)
    result["counters"] = store.counters.as_dict()
    store.close()
    Path(result_path).write_text(json.dumps(result))
    sys.exit(1 if result["bad"] or result["counters"]["corrupt"] else 0)
