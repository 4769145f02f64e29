"""What a size cap keeps: entries kept and share of the cap used, per entry size.

For each entry size from 1 KiB to cap/4, a fresh DiskStore under ``cap``
receives new keys until three caps' worth was put (the tier is then long
full). In the last two thirds of the run the bytes on disk (entry files
plus extracted copies, counted by walking the directory, not by the tier's
own counters) are sampled 16 times; the table shows the smallest and the
largest share of the cap, the entries kept at the end, and whether the
entry just put was still there after its own put (``own put kept``: the
share of puts whose entry survived it). The ``path()`` rows call
``Entry.path()`` on every entry after its put, so extracted copies count too.

Only the public API is used, so the same script measures any version of the
tier (``PYTHONPATH=<checkout>/src``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

from kernelcache import DiskStore, Entry

KIB = 1024
#: Entry sizes as fractions of the cap beyond the fixed small sizes.
_FIXED = (KIB, 4 * KIB, 16 * KIB, 64 * KIB)
_FRACTIONS = (64, 32, 16, 8, 4)
_SAMPLES = 16


def sizes(cap: int) -> list[int]:
    """1 KiB ... 64 KiB, then cap/64 ... cap/4 (each size once, ascending)."""
    return sorted({s for s in _FIXED if s <= cap // 4} | {cap // f for f in _FRACTIONS})


def disk_bytes(root: str) -> int:
    """Bytes of every entry file and extracted copy under ``root``/v1 (``extracted``; older
    versions kept copies in ``files``)."""
    total = 0
    for part in ("entries", "extracted", "files"):
        for dirpath, _dirs, names in os.walk(os.path.join(root, "v1", part)):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
    return total


def fill(root: str, cap: int, size: int, extract: bool, rounds: float = 3.0) -> dict[str, float]:
    """Put ``rounds`` caps' worth of ``size``-byte entries; what stayed, sampled."""
    rng = random.Random(size)
    store = DiskStore(root, max_bytes=cap)
    payload = rng.randbytes(size)
    puts = max(4, int(rounds * cap / size))
    sample_every = max(1, (puts - puts // 3) // _SAMPLES)
    shares: list[float] = []
    kept_own = 0
    try:
        for i in range(puts):
            key = f"{rng.getrandbits(128):032x}"
            # Distinct bytes per entry: extracted folders are named by content.
            store.put(key, Entry({"kernel.cubin": i.to_bytes(8, "little") + payload[8:]}))
            got = store.get(key)
            if got is not None:
                kept_own += 1
                if extract:
                    got.path("kernel.cubin")
            if i >= puts // 3 and (i - puts // 3) % sample_every == 0:
                shares.append(disk_bytes(root) / cap)
        kept = len(list(store.keys()))
    finally:
        store.close()
    return {
        "size": size,
        "extract": extract,
        "entries_kept": kept,
        "share_min": min(shares),
        "share_max": max(shares),
        "share_end": disk_bytes(root) / cap,
        "own_put_kept": kept_own / puts,
        "evictions": float(store.counters.evictions),
    }


def run(root: str, cap: int) -> list[dict[str, float]]:
    rows = []
    for extract in (False, True):
        for size in sizes(cap):
            path = os.path.join(root, f"cap-{size}-{int(extract)}")
            rows.append(fill(path, cap, size, extract))
    return rows


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: Sequence[dict[str, float]], cap: int) -> str:
    lines = [
        f"| entry size (cap {_size(cap)}) | path() | entries kept | share of cap min–max "
        "(end) | own put kept |",
        "|---:|---|---:|---|---:|",
    ]
    for r in rows:
        fraction = f" (cap/{cap // int(r['size'])})" if r["size"] > 64 * KIB else ""
        lines.append(
            f"| {_size(r['size'])}{fraction} | {'yes' if r['extract'] else 'no'} "
            f"| {int(r['entries_kept'])} | {r['share_min']:.0%}–{r['share_max']:.0%} "
            f"({r['share_end']:.0%}) | {r['own_put_kept']:.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=int, default=16 << 20, help="cap in bytes (default 16 MiB)")
    parser.add_argument("--dir", help="where to create the scratch directory")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="kernelcache-captable-", dir=args.dir)
    try:
        print(table(run(scratch, args.cap), args.cap))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
