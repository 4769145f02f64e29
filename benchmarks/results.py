"""One JSON shape for every benchmark's results (``--json FILE``), read by ``render.py``.

A results file says what a reader needs to trust a figure: the machine, the date,
the command, the contenders, and each target with what was measured and its
verdict. Each script keeps its own detailed figures under ``details``.

    {"schema": 1, "benchmark": "bench_stores", "date": "2026-11-28T17:30:00+00:00",
     "command": "python benchmarks/bench_stores.py --quick", "machine": {...},
     "contenders": ["kernelcache DiskStore", "diskcache", ...],
     "targets": [{"target": "...", "measured": "...", "ratio": "0.96×", "verdict": "PASS"}],
     "details": {...}}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
#: What a verdict may say: a target met or missed, a figure shown for information,
#: a target that could not be measured here, or a count ("9 of 9 modes").
VERDICTS = ("PASS", "MISS", "info", "n/a")
ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """The machine and software the figures were taken on, and its load when they started."""
    from kernelcache import __version__

    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "system": platform.platform(),
        "kernelcache": __version__,
        "commit": _commit(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that produced the figures, as a reader would type it (no ``--json``)."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0])
    if script.is_absolute() and script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    rest: list[str] = []
    skip = False
    for arg in args[1:]:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            rest.append(arg)
    return " ".join(["python", str(script), *rest])


def target(
    name: str, measured: str, verdict: str | bool, *, ratio: str = "", limit: str = ""
) -> dict[str, str]:
    """One target row; ``verdict`` True/False is PASS/MISS."""
    if isinstance(verdict, bool):
        verdict = "PASS" if verdict else "MISS"
    row = {"target": name, "measured": measured, "verdict": verdict}
    if ratio:
        row["ratio"] = ratio
    if limit:
        row["limit"] = limit
    return row


def check(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The target rows, each with a target, a measured value and a known verdict (or a count)."""
    out = []
    for row in rows:
        missing = {"target", "measured", "verdict"} - set(row)
        if missing:
            raise ValueError(f"a target row lacks {sorted(missing)}: {dict(row)}")
        verdict = str(row["verdict"])
        if verdict not in VERDICTS and " of " not in verdict:
            raise ValueError(f"unknown verdict {verdict!r} in {dict(row)}; use one of {VERDICTS}")
        out.append({k: str(v) for k, v in row.items()})
    return out


def document(
    benchmark: str,
    *,
    contenders: Iterable[str],
    targets: Iterable[Mapping[str, Any]],
    details: Any = None,
    argv: Sequence[str] | None = None,
    started: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The results document; ``started``: :func:`machine` taken when the run began."""
    info = dict(started) if started is not None else machine()
    info["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command(argv),
        "machine": info,
        "contenders": list(dict.fromkeys(contenders)),
        "targets": check(targets),
        "details": details,
    }


def write(path: str | os.PathLike[str] | None, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` (nothing when ``path`` is None), atomically."""
    if path is None:
        return
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
