"""Launcher statistics: ``nvcc-stats.json`` in the cache directory, shared by all processes.

Every ``kernelcache nvcc`` call adds one to a counter (hits, misses,
uncacheable with its reason, failed; ``preprocessed_hits`` among the hits)
under an flock, once per call;
``kernelcache stats`` reads them back with :func:`launcher_stats`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from kernelcache import _trust

if TYPE_CHECKING:
    from typing import Any

    from kernelcache.settings import Settings

STATS_FILE = "nvcc-stats.json"
#: Days kept in the file's ``days`` (the oldest go first).
MAX_DAYS = 400


def stats_path(settings: Settings | None = None) -> str:
    from kernelcache.settings import Settings

    return os.path.join((settings or Settings.load()).dir, STATS_FILE)


def launcher_stats(settings: Settings | None = None) -> dict[str, Any]:
    """Counters of every launcher call on this cache directory (all processes)."""
    try:
        fd = os.open(stats_path(settings), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(1 << 20) or b"{}")
    except (OSError, ValueError, RecursionError):  # missing, a link, damaged: no counts
        data = {}
    return data if isinstance(data, dict) else {}


def count(
    settings: Settings,
    field: str,
    reason: str | None = None,
    saved: float = 0.0,
    detail: str | None = None,
) -> None:
    """Add one to ``field`` (and ``detail``, and ``reasons[reason]``) in the stats file, under flock."""
    import fcntl

    if settings.read_only:
        return  # read-only writes nothing into the (shared) directory
    try:  # a refused directory gets nothing; a link is never followed out of it
        dir_fd = _trust.open_dir(settings.dir, create=True)
        if dir_fd is None:  # pragma: no cover - create=True makes it
            return
        try:
            fd = _trust.open_file(dir_fd, STATS_FILE, os.O_RDWR | os.O_CREAT)
        finally:
            os.close(dir_fd)
    except (OSError, _trust.UntrustedDirectory):
        return  # statistics never fail a build
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 1 << 20, 0)
        try:
            data = _add(json.loads(raw or b"{}"), field, reason, saved, detail)
        except (ValueError, TypeError, AttributeError, RecursionError):
            data = _add({}, field, reason, saved, detail)  # damaged: counting starts over
        encoded = json.dumps(data, sort_keys=True).encode()
        # Pad instead of truncating: truncating a file with data makes ext4
        # flush it (auto_da_alloc), ~3 ms per call. JSON allows trailing spaces.
        os.pwrite(fd, encoded.ljust(len(raw)), 0)
    except OSError:
        return
    finally:
        os.close(fd)


def _add(
    data: Any, field: str, reason: str | None, saved: float, detail: str | None
) -> dict[str, Any]:
    """``data`` (the parsed file) with one call counted; raises on a damaged document."""
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    for name in (field, detail):
        if name is not None:
            data[name] = int(data.get(name, 0)) + 1
    if reason is not None:
        reasons = data.setdefault("reasons", {})
        reasons[reason] = int(reasons.get(reason, 0)) + 1
    if saved:
        data["seconds_saved"] = round(float(data.get("seconds_saved", 0.0)) + saved, 6)
    if field in ("hits", "misses"):  # per day, for `kernelcache stats --days`
        import time

        days = data.setdefault("days", {})
        today = days.setdefault(time.strftime("%Y-%m-%d"), {})
        today[field] = int(today.get(field, 0)) + 1
        if saved:
            today["seconds_saved"] = round(float(today.get("seconds_saved", 0.0)) + saved, 6)
        for old in sorted(days)[:-MAX_DAYS]:
            del days[old]
    return data
