"""Parsing and printing of sizes (``5G``) and ages (``30d``) for settings and the CLI."""

from __future__ import annotations

import re

from kernelcache.errors import ConfigError

#: The largest size accepted: what a signed 64-bit file offset can count.
MAX_SIZE = (1 << 63) - 1
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*")
_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


def parse_size(text: str | int) -> int:
    """``"5G"`` → 5 GiB in bytes; binary units K, M, G, T with optional ``B``/``iB``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        if text > MAX_SIZE:
            raise ConfigError(f"size {text} is too large (at most 8 EiB)")
        return text
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ConfigError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 500M or 5G"
        )
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if not size <= MAX_SIZE:  # also inf, from a number with hundreds of digits
        raise ConfigError(f"size {str(text)[:40]!r} is too large (at most 8 EiB)")
    return int(size)


def parse_age(text: str) -> float:
    """``"30d"`` → seconds; units s, m, h, d, w (seconds when none)."""
    match = _AGE.fullmatch(str(text))
    if match is None:
        raise ConfigError(
            f"invalid age {text!r}: use a number with a unit s, m, h, d or w, e.g. 30d"
        )
    return float(match.group(1)) * _AGE_UNITS[match.group(2) or "s"]


def format_size(n: float) -> str:
    """Bytes as a short human string: ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
