"""``kernelcache stats``: the statistics report, as a table or as JSON.

Totals per tier for the current period and the lifetime (from the statistics
file), the disk tier's size, and the nvcc launcher's counters.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernelcache.settings import Settings


def cmd_stats(args: argparse.Namespace, settings: Settings) -> int:
    from kernelcache.cli.common import named, open_cache, require_cache
    from kernelcache.cli.output import print_json
    from kernelcache.errors import ReadOnlyStoreError, StoreError
    from kernelcache.stats import totals as stats_file

    require_cache(settings, remote=True)
    usage: dict[str, dict[str, Any]] = {}
    with open_cache(settings, write=False) as cache:
        directory = cache.stats_dir or settings.dir
        for name, tier in named(cache.tiers):
            if tier.in_process:
                continue
            try:
                entries, size = tier.usage()
            except StoreError:  # counted by the tier; shown as unknown
                usage[name] = {"entries": None, "bytes": None, "max_bytes": tier.max_bytes}
                continue
            usage[name] = {"entries": entries, "bytes": size, "max_bytes": tier.max_bytes}
    if args.zero and settings.read_only:  # read-only "writes nothing", statistics included
        raise ReadOnlyStoreError(
            f"the cache is read-only (KERNELCACHE_READONLY): stats --zero changed nothing in "
            f"{directory}"
        )
    if args.zero and stats_file.zero_period(directory) and not args.json:
        print("Started a new statistics period (lifetime totals kept).")
    totals = stats_file.read_totals(directory)
    if totals.get("damaged"):
        print(
            "kernelcache: warning: the statistics file is damaged; showing zeros", file=sys.stderr
        )
    first = next(iter(usage.values()), {"entries": 0, "bytes": 0, "max_bytes": None})
    from kernelcache import fstype

    report: dict[str, Any] = {
        "dir": directory,
        "filesystem": fstype.report(directory),
        "entries": first["entries"],  # the first persistent tier, as before tiers were listed
        "bytes": first["bytes"],
        "max_bytes": first["max_bytes"],
        "usage": usage,
    }
    for name in ("period", "lifetime"):
        report[name] = _complete(totals[name])
    from kernelcache.stats.launcher import launcher_stats

    report["nvcc_launcher"] = launcher_stats(settings)
    report["families"] = {
        name: _complete(totals[name])["families"] for name in ("period", "lifetime")
    }
    if args.days is not None:
        from kernelcache.cli.metrics import day_rows, days_text

        rows = day_rows(totals, args.days, report["nvcc_launcher"])
        print_json(rows) if args.json else print(days_text(rows))
        return 0
    if args.format == "openmetrics":
        from kernelcache.cli.metrics import openmetrics

        sys.stdout.write(openmetrics(report))
    elif args.json or args.format == "json":
        print_json(report)
    else:
        print(_stats_text(report))
    return 0


def _complete(section: dict[str, Any]) -> dict[str, Any]:
    """A stats section with every counter present and hit rates computed."""
    from kernelcache.stats.totals import COMPILE_FIELDS, TIER_FIELDS

    tiers = {}
    for name, counts in section["tiers"].items():
        full = {field: counts.get(field, 0) for field in TIER_FIELDS} | counts
        lookups = full["hits"] + full["misses"]
        full["hit_rate"] = full["hits"] / lookups if lookups else None
        tiers[name] = full
    compiles = {field: section["compile"].get(field, 0) for field in COMPILE_FIELDS}
    families = section.get("families", {})
    return {"since": section["since"], "tiers": tiers, "compile": compiles, "families": families}


#: How the report names (and orders) counters that only some tiers keep; others follow
#: under their own names.
_LABELS = {
    "timeouts": "timeouts",
    "breaker_trips": "circuit-breaker trips",
    "skipped": "skipped while open",
    "forged": "forged",
}


def _stats_text(report: dict[str, Any]) -> str:
    from kernelcache.cli.output import format_seconds, format_time, table
    from kernelcache.stats.totals import TIER_FIELDS
    from kernelcache.units import format_size

    fs = report["filesystem"]
    where = f"{fs['type']}, a network filesystem" if fs["network"] else fs["type"]
    lines = [f"directory  {report['dir']} (on {where})"]
    for name, use in report["usage"].items():
        if use["bytes"] is None:
            lines.append(f"{name:<10} unavailable")
            continue
        used = format_size(use["bytes"])
        if use["max_bytes"]:
            used += f" of {format_size(use['max_bytes'])} ({100 * use['bytes'] / use['max_bytes']:.1f}%)"
        lines.append(f"{name:<10} {use['entries']} entries, {used}")
    headers = [
        "TIER",
        "HITS",
        "MISSES",
        "RATE",
        "ERRORS",
        "PUTS",
        "EVICTED",
        "READ",
        "WRITTEN",
        "SAVED",
    ]
    for title in ("period", "lifetime"):
        section = report[title]
        rows = []
        for name, c in section["tiers"].items():
            rate = "-" if c["hit_rate"] is None else f"{100 * c['hit_rate']:.1f}%"
            rows.append(
                (
                    name,
                    c["hits"],
                    c["misses"],
                    rate,
                    c["errors"] + c["corrupt"],
                    c["puts"],
                    c["evictions"],
                    format_size(c["bytes_read"]),
                    format_size(c["bytes_written"]),
                    format_seconds(c["seconds_saved"]),
                )
            )
        comp = section["compile"]
        lines += ["", f"{title} since {format_time(section['since'])}"]
        lines.append(table(headers, rows, right=range(1, 10)) if rows else "  (no activity)")
        for name, c in section["tiers"].items():
            # Counters only some tiers keep (a remote tier's timeouts, breaker trips, ...).
            own = sorted(
                ((k, v) for k, v in c.items() if k not in TIER_FIELDS and k != "hit_rate"),
                key=lambda kv: (list(_LABELS).index(kv[0]) if kv[0] in _LABELS else 99, kv[0]),
            )
            if own:
                lines.append(f"{name}: " + ", ".join(f"{_LABELS.get(k, k)} {v}" for k, v in own))
        lines.append(
            f"compiles {comp['compiles']} ({format_seconds(comp['compile_seconds'])}), "
            f"failed {comp['compile_errors']}, waited for another's compile "
            f"{comp['flight_waits']}, lock timeouts {comp['lock_timeouts']}"
        )
    launcher = report.get("nvcc_launcher") or {}
    if launcher:
        counts = ", ".join(
            f"{n} {launcher.get(n, 0)}" for n in ("hits", "misses", "uncacheable", "failed")
        )
        lines += [
            "",
            f"nvcc launcher (lifetime): {counts}, saved {launcher.get('seconds_saved', 0):.1f} s",
        ]
        for reason, n in sorted(launcher.get("reasons", {}).items(), key=lambda item: -item[1]):
            lines.append(f"  uncacheable: {n:>6}  {reason}")
    return "\n".join(lines)
