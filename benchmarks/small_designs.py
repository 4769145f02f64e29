"""What a distinct-key 4 KB hit costs in each design the disk tier could take (issue 40).

    PYTHONPATH=src python benchmarks/small_designs.py [--keys N] [--passes N]

Measured, not built: each row but the first two is the least a design's hit
does, with the entry verified as every kernelcache read is (the same
``unpack_from`` over the same packed bytes):

- ``DiskStore.get``: as shipped (small entries packed, issue 40: stores/disk/pack.py),
  and with ``pack_max = 0``, a file per entry as before packing.
- file floor: the system calls a verified hit of a file per entry with an
  mtime LRU clock needs (open, fstat, pread, close) and the verification;
  nothing else. What trimming the disk store's read path can reach at best.
- SQLite row: the packed entry inline in a rowid table with a key index,
  WAL and ``mmap_size`` (diskcache's settings), then verified.
- pack + mapped index: one ``pread`` of a per-shard append-only pack at the
  offset an open-addressing table in a shared mapping gives (no system call
  for the lookup), then verified.

Every contender holds the same keys; they take turns key by key, in an order
shuffled per key, so load from other processes lands on all alike. Medians,
with the ratio to diskcache (which reads SQLite rows through a 64 MB mapping
and checks nothing).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import xxhash

from kernelcache import DiskStore, Entry
from kernelcache.entry_format import unpack_from
from kernelcache.stores.disk.layout import NOATIME, OPEN_READ, SHARDS

SIZE = 4096
_SLOT = struct.Struct("<QQI")  # key hash, offset, length
_SLOTS = 1 << 16


class Pack:
    """One append-only file per shard and an open-addressing index in a mapping."""

    def __init__(self, folder: str) -> None:
        self.fds = [
            os.open(f"{folder}/pack{s}", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            for s in range(SHARDS)
        ]
        self.index = mmap.mmap(-1, _SLOT.size * _SLOTS * SHARDS)

    def put(self, key: str, packed: bytes) -> None:
        digest = xxhash.xxh3_64_intdigest(key.encode())
        shard = digest % SHARDS
        fd = self.fds[shard]
        offset = os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, packed)
        slot = (digest >> 4) % _SLOTS
        base = shard * _SLOTS
        while _SLOT.unpack_from(self.index, (base + slot) * _SLOT.size)[0] not in (0, digest):
            slot = (slot + 1) % _SLOTS
        _SLOT.pack_into(self.index, (base + slot) * _SLOT.size, digest, offset, len(packed))

    def get(self, key: str) -> dict[str, bytes] | None:
        digest = xxhash.xxh3_64_intdigest(key.encode())
        shard = digest % SHARDS
        slot = (digest >> 4) % _SLOTS
        base = shard * _SLOTS
        while True:
            found, offset, length = _SLOT.unpack_from(self.index, (base + slot) * _SLOT.size)
            if found == digest:
                head = os.pread(self.fds[shard], length, offset)
                return unpack_from(head, length, key)[2]
            if found == 0:
                return None
            slot = (slot + 1) % _SLOTS

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.index.close()


def run(root: str, keys: int, passes: int) -> dict[str, float]:
    """Median nanoseconds per hit, by design."""
    import diskcache

    value = random.Random(SIZE).randbytes(SIZE)
    entry = Entry({"data": value})
    store = DiskStore(f"{root}/disk")
    files = DiskStore(f"{root}/files")
    files.pack_max = 0  # a file per entry, as before packing
    folders = files.layout.folders
    dc = diskcache.Cache(f"{root}/diskcache")
    db = sqlite3.connect(f"{root}/rows.sqlite", isolation_level=None)
    for pragma in ("journal_mode = WAL", "synchronous = NORMAL", "mmap_size = 67108864"):
        db.execute(f"PRAGMA {pragma}")
    db.execute("CREATE TABLE entries (key TEXT UNIQUE, data BLOB)")
    pack = Pack(root)
    key_shard: dict[str, str] = {}

    def file_floor(key: str) -> dict[str, bytes]:
        folder = folders[key_shard[key]]
        fd = os.open(key + ".kce", OPEN_READ | NOATIME, dir_fd=folder)
        try:
            size = os.fstat(fd).st_size
            return unpack_from(os.pread(fd, size, 0), size, key)[2]
        finally:
            os.close(fd)

    def row(key: str) -> dict[str, bytes]:
        data: bytes = db.execute("SELECT data FROM entries WHERE key = ?", (key,)).fetchone()[0]
        return unpack_from(data, len(data), key)[2]

    contenders: dict[str, Callable[[str], object]] = {
        "diskcache.Cache.get": dc.get,
        "kernelcache DiskStore.get (packed, as shipped)": store.get,
        "kernelcache DiskStore.get (file per entry, pack_max=0)": files.get,
        "file floor: open+fstat+pread+close, verified": file_floor,
        "SQLite row (rowid, mmap), verified": row,
        "pack + mapped index: one pread, verified": pack.get,
    }
    samples: dict[str, list[int]] = {name: [] for name in contenders}
    rnd = random.Random(0)
    clock = time.perf_counter_ns
    try:
        for _pass in range(passes):
            names = [f"{rnd.getrandbits(256):064x}" for _ in range(keys)]
            for key in names:
                store.put(key, entry)
                files.put(key, entry)
                packed = b"".join(entry.pack_parts(key))
                dc.set(key, value)
                db.execute("INSERT INTO entries VALUES (?, ?)", (key, packed))
                pack.put(key, packed)
                key_shard[key] = os.path.basename(os.path.dirname(files.layout.entry_path(key)))
                files.layout.entries_fd(key_shard[key])
            order = list(contenders.items())
            for key in names:
                rnd.shuffle(order)
                for name, get in order:
                    start = clock()
                    got = get(key)
                    samples[name].append(clock() - start)
                    if got is None:
                        raise AssertionError(f"{name} missed {key}")
    finally:
        store.close()
        files.close()
        dc.close()
        db.close()
        pack.close()
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1500, help="distinct keys per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dir", help="where to make the benchmark's directory (removed after)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernelcache-designs-", dir=args.dir) as root:
        medians = run(root, args.keys, args.passes)
    ref = medians["diskcache.Cache.get"]
    print(f"Distinct-key {SIZE // 1024} KB hits, {args.keys} keys x {args.passes} passes")
    print(f"load average {os.getloadavg()[0]:.2f}\n")
    print("| design | median hit | / diskcache |\n|---|---:|---:|")
    for name, median in medians.items():
        print(f"| {name} | {median / 1000:.2f} µs | {median / ref:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
