"""Caches on a network filesystem: kernelcache vs Triton's FileCacheManager vs diskcache (issue 22).

    PYTHONPATH=src python benchmarks/bench_netfs.py [--quick | --smoke] [--modes a,b] [--json FILE]

Needs FUSE (root, /dev/fuse, fuse3 and libfuse3-dev; see tests/netfs.py). Two
mounts of tests/netfs/netfs.c over one directory stand in for two nodes of
NFS, Lustre or GPFS. Two parts:

1. Per fault mode (tests/netfs_stress.py MODES), 4 processes on each node
   share 50 keys under a 256 KiB cap (Triton has no cap): wrong bytes
   returned, exceptions that reached the caller (crashes and hung processes
   included), compiles per key across both nodes when all ask for the same
   keys at once, ``kernelcache verify`` (kernelcache only), bytes stored.
   Targets: 0, 0, 1 per key, clean; the longest any call waited on others
   (its own compile left out) at most 5 s. A cache "holds" in a mode when it
   returns no wrong bytes, lets no exception through and nothing hangs.
2. Round trips (requests the filesystem answered, counted per mount) per hit
   and per put, and the median hit latency, at 2 ms per request; one
   process, warm, 50 keys put (eviction included) then each read back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import netfs
import netfs_stress as st
import netfs_worker as worker
import results
from kernelcache.stores.disk import cleaner

KINDS = {
    "kernelcache": "kernelcache",
    "triton": "Triton FileCacheManager",
    "diskcache": "diskcache",
}
LATENCY_US = 2000


def available(kind: str) -> str | None:
    """Why ``kind`` cannot run here (its package is missing), or ``None``."""
    module = {"triton": "triton", "diskcache": "diskcache"}.get(kind)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} not installed: {exc}"
    return None


def stress_rows(
    root: Path, modes: Sequence[st.Mode], kinds: Sequence[str], size: dict[str, int]
) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        for kind in kinds:
            folder = Path(tempfile.mkdtemp(prefix=f"{mode.name}-{kind}-", dir=root))
            with netfs.mounted(folder, mode.flock, mode.faults) as fs:
                result = st.stress(fs, kind, "cache", **size, timeout=300)
                for node in fs.nodes:
                    node.set(netfs.NO_FAULTS)
                verified = "n/a"
                if kind == "kernelcache":
                    status, bad = st.verify(fs.nodes[0].path / "cache")
                    verified = "clean" if (status, bad) == (0, []) else f"{len(bad)} damaged"
                stored = st.stored_bytes(fs.backing / "cache")
            holds = result.wrong == 0 and result.escaped_total == 0 and result.hung == 0
            rows.append({
                "mode": mode.name, "cache": kind, "wrong": result.wrong,
                "escaped": result.escaped_total + result.hung, "hung": result.hung,
                "errors": result.escaped, "compiles_per_key": round(result.mean_per_key, 2),
                "max_per_key": result.max_per_key, "verify": verified, "stored": stored,
                "holds": holds, "seconds": round(result.seconds, 1),
                "slowest_s": round(result.slowest, 1),
            })  # fmt: skip
            print(f"  {mode.name:14} {kind:12} {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def cost_rows(
    root: Path, kinds: Sequence[str], keys: int, cap: int, hits: int, attr_ms: int
) -> list[dict[str, Any]]:
    """Round trips and latency at 2 ms per request; names and attributes cached ``attr_ms``."""
    rows = []
    for kind in kinds:
        folder = Path(tempfile.mkdtemp(prefix=f"cost-{kind}-", dir=root))
        with netfs.mounted(folder, "local") as fs:
            node = fs.nodes[0]
            cache = worker.KINDS[kind](str(node.path / "cache"), cap)
            cache.get_or_compile(worker.key_name(0, "warm"), lambda: b"warm")  # creates the layout
            node.set(netfs.Faults(latency_us=LATENCY_US, attr_timeout_ms=attr_ms))
            names = [worker.key_name(i) for i in range(keys)]
            puts, put_first = [], node.counts()
            for key in names:
                before = node.counts()
                cache.get_or_compile(key, lambda key=key: worker.value_of(key))
                if kind == "kernelcache" and hasattr(cleaner, "finish"):
                    cleaner.finish()  # its eviction thread's requests count for this put
                puts.append(node.round_trips(before))
            put_last = node.counts()
            recent = names[-min(hits, keys // 4) :]  # still cached whatever the cap evicted
            trips, times, first = [], [], node.counts()
            for key in recent:

                def refuse() -> bytes:
                    raise AssertionError("a hit was expected")

                before, start = node.counts(), time.perf_counter()
                data = cache.get_or_compile(key, refuse)
                times.append(time.perf_counter() - start)
                trips.append(node.round_trips(before))
                assert data == worker.value_of(key)
            last = node.counts()
        per_hit = {
            op: round((last[op] - first[op]) / len(recent), 1)
            for op in netfs.OPS
            if last[op] > first[op]
        }
        per_put = {
            op: round((put_last[op] - put_first[op]) / len(names), 1)
            for op in netfs.OPS
            if put_last[op] > put_first[op] and op not in netfs.NOT_ROUND_TRIPS
        }
        rows.append({
            "cache": kind, "attr_ms": attr_ms, "hit_ops": per_hit, "put_ops": per_put, "hit_round_trips": statistics.median(trips),
            "hit_ms": round(statistics.median(times) * 1000, 1),
            "put_round_trips": round(statistics.mean(puts), 1), "put_round_trips_max": max(puts),
        })  # fmt: skip
        print(f"  cost {kind:12} {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def verdicts(stress: list[dict[str, Any]], cost: list[dict[str, Any]]) -> list[dict[str, str]]:
    """kernelcache's targets across the modes, and in how many modes each cache held."""
    out = []
    ours = [r for r in stress if r["cache"] == "kernelcache"]
    modes = f"{len(ours)} modes"
    worst = max((r["max_per_key"] for r in ours), default=0)
    for what, measured, ok in (
        ("wrong bytes returned: 0 in every mode", f"{sum(r['wrong'] for r in ours)} in {modes}",
         all(r["wrong"] == 0 for r in ours)),
        ("exceptions (and hangs) reaching the caller: 0 in every mode",
         f"{sum(r['escaped'] for r in ours)} in {modes}", all(r["escaped"] == 0 for r in ours)),
        ("kernelcache verify clean in every mode",
         f"clean in {sum(r['verify'] == 'clean' for r in ours)} of {modes}",
         all(r["verify"] == "clean" for r in ours)),
        ("1 compile per key across both nodes in every mode", f"at most {worst} per key",
         all(r["max_per_key"] <= 1 for r in ours)),
    ):  # fmt: skip
        out.append(results.target(what, measured, ok))
    for kind in KINDS:
        theirs = [r for r in stress if r["cache"] == kind]
        if theirs:
            held = sum(r["holds"] for r in theirs)
            out.append(
                {"target": f"{KINDS[kind]} holds in", "measured": f"{held} of {len(theirs)} modes",
                 "verdict": f"{held} of {len(theirs)} modes"}
            )  # fmt: skip
    for attr_ms in sorted({r["attr_ms"] for r in cost}):
        put = {r["cache"]: r for r in cost if r["attr_ms"] == attr_ms}
        if "kernelcache" in put and "triton" in put:
            ours_put, theirs_put = put["kernelcache"], put["triton"]
            ratio = ours_put["put_round_trips"] / max(theirs_put["put_round_trips"], 1)
            out.append(
                results.target(
                    f"requests per put, attribute cache {attr_ms} ms, kernelcache / Triton",
                    f"{ours_put['put_round_trips']} / {theirs_put['put_round_trips']}; "
                    f"kernelcache: {ops_text(ours_put['put_ops'])}; "
                    f"Triton: {ops_text(theirs_put['put_ops'])}",
                    "info",
                    ratio=f"{ratio:.2f}×",
                )
            )
    by = {r["cache"]: r for r in cost if r["attr_ms"] == 0}
    if "kernelcache" in by and "triton" in by:
        ours_rt, theirs_rt = by["kernelcache"]["hit_round_trips"], by["triton"]["hit_round_trips"]
        out.append(
            results.target(
                f"round trips per hit <= Triton's ({ours_rt} vs {theirs_rt})",
                f"{ours_rt} / {theirs_rt}",
                ours_rt <= theirs_rt,
            )
        )
    return out


def ops_text(ops: dict[str, float]) -> str:
    """``{"lookup": 3.0, "create": 1.0}`` as ``lookup 3, create 1``."""
    return ", ".join(f"{op} {n:g}" for op, n in ops.items())


def put_ops_table(cost: list[dict[str, Any]]) -> list[str]:
    """Requests per put by kind, one column per cache and attribute cache, side by side."""
    columns = [r for r in cost if r["put_ops"]]
    ops = [op for op in netfs.OPS if any(op in r["put_ops"] for r in columns)]
    lines = [
        "| request | "
        + " | ".join(f"{KINDS[r['cache']]}, {r['attr_ms']} ms" for r in columns)
        + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for op in ops:
        lines.append(
            f"| {op} | " + " | ".join(f"{r['put_ops'].get(op, 0):g}" for r in columns) + " |"
        )
    lines.append(
        "| **all** | " + " | ".join(f"**{sum(r['put_ops'].values()):.1f}**" for r in columns) + " |"
    )
    return lines


def render(
    stress: list[dict[str, Any]], cost: list[dict[str, Any]], checks: list[dict[str, str]]
) -> str:
    lines = [
        "| mode | cache | wrong bytes | escaped (hung) | compiles/key (max) | verify | stored bytes | holds | longest wait |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in stress:
        lines.append(
            f"| {r['mode']} | {KINDS[r['cache']]} | {r['wrong']} | {r['escaped']} ({r['hung']}) | "
            f"{r['compiles_per_key']} ({r['max_per_key']}) | {r['verify']} | {r['stored']} | "
            f"{'yes' if r['holds'] else 'NO'} | {r['slowest_s']} s |"
        )
    lines += [
        "",
        f"At {LATENCY_US / 1000:g} ms per request; names and attributes not cached, or for 1 s (NFS actimeo):",
        "",
    ]
    lines += [
        "| cache | attr cache | round trips per hit | hit (median) | round trips per put (mean, max) | requests per hit |",
        "|---|---|---|---|---|---|",
    ]
    for r in cost:
        ops = ", ".join(f"{op} {n:g}" for op, n in r["hit_ops"].items())
        lines.append(
            f"| {KINDS[r['cache']]} | {r['attr_ms']} ms | {r['hit_round_trips']} | {r['hit_ms']} ms | "
            f"{r['put_round_trips']}, {r['put_round_trips_max']} | {ops} |"
        )
    lines += [
        "",
        "Requests per put (a miss: lookup, compile, store; eviction included), by kind,"
        " per cache and attribute cache:",
        "",
        *put_ops_table(cost),
    ]
    lines += ["", "| target | verdict |", "|---|---|"]
    lines += [f"| {c['target']} | {c['verdict']} |" for c in checks]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer calls per process (a few minutes)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one mode, one process per node, a few calls (the smoke test: seconds)",
    )
    parser.add_argument("--modes", help="comma-separated modes (default: all)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--cost-only", action="store_true", help="only the round trips and latency (part 2)"
    )
    args = parser.parse_args(argv)
    reason = netfs.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    modes = [st.BY_NAME[m] for m in args.modes.split(",")] if args.modes else list(st.MODES)
    size = {"procs": 4, "keys": 50, "ops": 100, "cap": 256 * 1024}
    if args.quick:
        size["ops"] = 30
    if args.smoke:
        modes, size = (
            modes[:1] if args.modes else [st.BY_NAME["flock-local"]],
            {"procs": 1, "keys": 4, "ops": 2, "cap": 256 * 1024},
        )
    started = results.machine()
    kinds = [k for k in KINDS if available(k) is None]
    for kind in sorted(set(KINDS) - set(kinds)):
        print(f"{KINDS[kind]}: n/a ({available(kind)})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-netfs-") as tmp:
        stress = [] if args.cost_only else stress_rows(Path(tmp), modes, kinds, size)
        keys, hits = (4, 2) if args.smoke else (50, 10)
        cost = [
            row
            for attr_ms in ((0,) if args.smoke else (0, 1000))
            for row in cost_rows(Path(tmp), kinds, keys, size["cap"], hits, attr_ms)
        ]
    checks = verdicts(stress, cost)
    print(render(stress, cost, checks))
    results.write(
        args.json,
        results.document(
            "bench_netfs",
            contenders=[KINDS[k] for k in kinds],
            targets=checks,
            details={"stress": stress, "cost": cost},
            argv=None if argv is None else [sys.argv[0], *argv],
            started=started,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
