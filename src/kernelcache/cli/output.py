"""Human output for the CLI: aligned tables, progress bars, short ages and times."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

_AGE_UNITS = (("w", 604800.0), ("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Rows as text columns; columns whose index is in ``right`` are right-aligned (numbers)."""
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def print_json(value: Any, stream: TextIO | None = None) -> None:
    json.dump(value, stream or sys.stdout, indent=2, sort_keys=True)
    (stream or sys.stdout).write("\n")


def format_age(seconds: float) -> str:
    """A duration in the units ``prune --older-than`` takes: ``45s``, ``12m``, ``3.5d``."""
    seconds = max(0.0, seconds)
    for unit, size in _AGE_UNITS:
        if seconds >= size or unit == "s":
            value = seconds / size
            return f"{value:.0f}{unit}" if value >= 10 or unit == "s" else f"{value:.1f}{unit}"
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """Compile time or time saved: ``0.25 s``, ``12.5 s``, ``3.1 min``, ``2.0 h``."""
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_time(epoch: float) -> str:
    """A local date and time, with how long ago it was."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"{stamp} ({format_age(time.time() - epoch)} ago)"


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal.

    Redrawn at most ten times a second, so a million tiny entries do not
    spend their time printing.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._drawn = 0.0

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._drawn < 0.1:
            return
        self._drawn = now
        fraction = done / self.total if self.total else 1.0
        filled = int(30 * fraction)
        bar = "#" * filled + "-" * (30 - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total}")
        self.stream.flush()

    def set(self, done: int, total: int) -> None:
        """Progress when the total is learnt along the way (a ``maintenance.Progress``)."""
        self.total = total
        self.update(done)

    def close(self) -> None:
        if self.enabled:
            self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()
