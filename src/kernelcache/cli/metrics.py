"""``kernelcache stats --format openmetrics`` and ``--days``: numbers a team can watch.

The OpenMetrics text (what Prometheus scrapes, through a textfile collector or
an exporter's ``/metrics``) comes from the lifetime totals, whose counters
only grow: hits, misses, puts, errors and seconds saved per tier, compiles
per integration family, the misses whose reason a tier or the launcher
knows, and bytes stored per tier as gauges. ``--days`` prints the seconds
saved per day with a small text chart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

#: Tier counters that are the reason of a miss (an entry that was there but unusable).
MISS_REASONS = ("corrupt", "errors", "timeouts", "forged", "unverifiable", "oversized", "skipped")
_TIER_COUNTERS = {
    "hits": "Lookups answered by the tier.",
    "misses": "Lookups the tier could not answer.",
    "puts": "Entries written to the tier.",
    "evictions": "Entries the tier evicted under its caps.",
    "errors": "Failures of the tier (each a miss or a skipped write).",
    "bytes_read": "Bytes read from the tier on hits.",
    "bytes_written": "Bytes written to the tier.",
    "seconds_saved": "Compile seconds that hits in the tier saved.",
}
_FAMILY_COUNTERS = {
    "hits": "Hits of the integration's keys.",
    "misses": "Misses of the integration's keys.",
    "compiles": "Compiles stored by the integration.",
    "compile_seconds": "Seconds the integration's stored compiles took.",
    "seconds_saved": "Compile seconds that hits of the integration's keys saved.",
}
_LAUNCHER = ("hits", "misses", "uncacheable", "failed")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value)):
        return str(int(value))
    return repr(float(value))


def _family(
    name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]
) -> Iterator[str]:
    yield f"# TYPE {name} {kind}"
    yield f"# HELP {name} {help_}"
    for suffix, labels, value in samples:
        text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        yield (
            f"{name}{suffix}{{{text}}} {_number(value)}"
            if text
            else f"{name}{suffix} {_number(value)}"
        )


def openmetrics(report: dict[str, Any]) -> str:
    """The ``kernelcache stats --json`` report as OpenMetrics text (ending ``# EOF``)."""
    life = report["lifetime"]
    lines: list[str] = []
    tiers = life["tiers"]
    for counter, help_ in _TIER_COUNTERS.items():
        samples = [("_total", {"tier": t}, c.get(counter, 0)) for t, c in sorted(tiers.items())]
        lines += _family(f"kernelcache_tier_{counter}", "counter", help_, samples)
    reasons = [
        ("_total", {"tier": t, "reason": r}, c[r])
        for t, c in sorted(tiers.items())
        for r in MISS_REASONS
        if c.get(r)
    ]
    launcher = report.get("nvcc_launcher") or {}
    reasons += [
        ("_total", {"tier": "launcher", "reason": f"uncacheable: {reason}"}, n)
        for reason, n in sorted((launcher.get("reasons") or {}).items())
        if isinstance(n, (int, float))
    ]
    lines += _family("kernelcache_misses_by_reason", "counter",
                     "Misses and uncached compiles whose reason is known.", reasons)  # fmt: skip
    families = life.get("families", {})
    for counter, help_ in _FAMILY_COUNTERS.items():
        samples = [
            ("_total", {"integration": f}, c.get(counter, 0)) for f, c in sorted(families.items())
        ]
        lines += _family(f"kernelcache_integration_{counter}", "counter", help_, samples)
    compile_ = life["compile"]
    lines += _family("kernelcache_compiles", "counter", "Compiles run through Cache.get_or_compile.",
                     [("_total", {}, compile_.get("compiles", 0))])  # fmt: skip
    lines += _family("kernelcache_launcher_calls", "counter", "nvcc launcher calls by outcome.",
                     [("_total", {"outcome": o}, launcher.get(o, 0)) for o in _LAUNCHER])  # fmt: skip
    lines += _family("kernelcache_launcher_seconds_saved", "counter",
                     "Compile seconds the nvcc launcher's hits saved.",
                     [("_total", {}, launcher.get("seconds_saved", 0))])  # fmt: skip
    usage = report.get("usage", {})
    lines += _family("kernelcache_stored_bytes", "gauge", "Bytes stored, per tier.",
                     [("", {"tier": t}, u["bytes"]) for t, u in sorted(usage.items())
                      if u.get("bytes") is not None])  # fmt: skip
    lines += _family("kernelcache_stored_entries", "gauge", "Entries stored, per tier.",
                     [("", {"tier": t}, u["entries"]) for t, u in sorted(usage.items())
                      if u.get("entries") is not None])  # fmt: skip
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def day_rows(
    totals: dict[str, Any], count: int, launcher: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The last ``count`` days with activity: date, seconds saved, hits, compiles (the
    cache's, plus the nvcc launcher's calls: its hits and the compiles of its misses)."""
    days = totals.get("days", {})
    calls = (launcher or {}).get("days", {})
    calls = calls if isinstance(calls, dict) else {}
    dates = sorted(d for d in {*days, *calls} if _DATE.fullmatch(d))[-count:]
    rows = []
    for d in dates:
        cache, nvcc = days.get(d, {}), calls.get(d, {})
        if not isinstance(cache, dict) or not isinstance(nvcc, dict):
            continue
        rows.append(
            {
                "date": d,
                "seconds_saved": float(cache.get("seconds_saved", 0))
                + float(nvcc.get("seconds_saved", 0)),
                "hits": int(cache.get("hits", 0)) + int(nvcc.get("hits", 0)),
                "compiles": int(cache.get("compiles", 0)) + int(nvcc.get("misses", 0)),
            }
        )
    return rows


def days_text(rows: list[dict[str, Any]], width: int = 40) -> str:
    """The per-day table with a bar of seconds saved per day (``█``, scaled to the largest)."""
    from kernelcache.cli.output import format_seconds, table

    if not rows:
        return "no days recorded yet (statistics are merged every few seconds and at exit)"
    top = max(r["seconds_saved"] for r in rows) or 1.0
    body = []
    for r in rows:
        bar = "█" * round(width * r["seconds_saved"] / top)
        if not bar and r["seconds_saved"] > 0:
            bar = "▏"
        body.append((r["date"], format_seconds(r["seconds_saved"]), r["hits"], r["compiles"], bar))
    total = sum(r["seconds_saved"] for r in rows)
    return (
        table(("DATE", "SAVED", "HITS", "COMPILES", ""), body, right=(1, 2, 3))
        + f"\n{len(rows)} days, {format_seconds(total)} saved"
    )
