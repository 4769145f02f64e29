"""Statistics shared by every process that uses a cache directory.

Layout under ``<dir>/v1/stats/``::

    totals.json      {"version": 1, "lifetime": SECTION, "period": SECTION}
    keys/<xx>.json   {key: [hits, seconds_saved]}, 256 shards, for ``ls --sort hits``
    lock             flock held while a process merges its counts in

SECTION is ``{"since": epoch, "tiers": {name: {counter: n}}, "compile": {counter: n},
"families": {integration: {counter: n}}}`` (families: hits, misses, compiles, seconds
saved per integration family, :func:`kernelcache.keys.family_of`). ``days`` holds the
seconds saved, hits and compiles per local date (``YYYY-MM-DD``), the last
:data:`MAX_DAYS` of them, for ``kernelcache stats --days``.
Processes merge batches of deltas (at exit and every few seconds), never one
write per hit. Readers need no lock: files are replaced atomically. A damaged
totals file is moved aside to ``totals.json.corrupt`` and counting starts over;
nothing in the cache itself depends on these files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import xxhash

from kernelcache import _fs
from kernelcache.stores.lockfile import close_lock_fd, lock_within, open_lock_fd

if TYPE_CHECKING:
    from typing import Any

    Section = dict[str, Any]

VERSION = 1
KEY_SHARDS = 256
#: What every tier reports; a tier may add counters of its own (Redis: timeouts, ...).
TIER_FIELDS = (
    "hits",
    "misses",
    "puts",
    "deletes",
    "evictions",
    "errors",
    "corrupt",
    "bytes_read",
    "bytes_written",
    "seconds_saved",
)
COMPILE_FIELDS = (
    "compiles",
    "compile_seconds",
    "compile_errors",
    "flight_waits",
    "lock_timeouts",
    "uncacheable",
)

KeyDeltas = Mapping[str, tuple[int, float]]
#: Days kept in ``days`` (the oldest go first).
MAX_DAYS = 400


def stats_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "v1", "stats")


def new_section(since: float | None = None) -> Section:
    return {"since": time.time() if since is None else since, "tiers": {}, "compile": {}}


def _new_totals() -> dict[str, Any]:
    now = time.time()
    return {"version": VERSION, "lifetime": new_section(now), "period": new_section(now)}


def _is_counts(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        for k, v in value.items()
    )


def _is_section(value: object) -> bool:
    families = value.get("families", {}) if isinstance(value, dict) else None
    return (
        isinstance(value, dict)
        and isinstance(value.get("since"), (int, float))
        and isinstance(value.get("tiers"), dict)
        and all(_is_counts(v) for v in value["tiers"].values())
        and _is_counts(value.get("compile"))
        and isinstance(families, dict)
        and all(_is_counts(v) for v in families.values())
    )


#: A statistics file larger than this is damaged (they hold counters, not data).
MAX_FILE_BYTES = 64 << 20


def _load_json(path: str) -> object:
    """The JSON document in ``path``; ``ValueError`` for anything that is not one.

    Statistics files are never trusted to be what their name says: a link is
    not followed, and a directory, a huge file or nesting deep enough to
    exhaust the parser's recursion are damage, like garbage.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise ValueError(f"{path} is not a file") from exc
        raise
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except IsADirectoryError as exc:
        raise ValueError(f"{path} is a directory") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is over {MAX_FILE_BYTES} bytes")
    try:
        return json.loads(raw)
    except RecursionError as exc:
        raise ValueError(f"{path} nests too deep") from exc


def read_totals(cache_dir: str) -> dict[str, Any]:
    """The totals of ``cache_dir`` (zeros if none); ``"damaged": True`` if unreadable."""
    try:
        doc = _load_json(os.path.join(stats_dir(cache_dir), "totals.json"))
    except FileNotFoundError:
        return _new_totals()
    except ValueError:
        return {**_new_totals(), "damaged": True}
    if (
        isinstance(doc, dict)
        and doc.get("version") == VERSION
        and _is_section(doc.get("lifetime"))
        and _is_section(doc.get("period"))
        and isinstance(doc.get("days", {}), dict)
        and all(_is_counts(v) for v in doc.get("days", {}).values())
    ):
        return doc
    return {**_new_totals(), "damaged": True}


def read_key_hits(cache_dir: str) -> dict[str, tuple[int, float]]:
    """``key -> (hits, seconds_saved)`` over all shards; damaged shards are skipped."""
    out: dict[str, tuple[int, float]] = {}
    folder = os.path.join(stats_dir(cache_dir), "keys")
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json"):
            out.update(_read_shard(os.path.join(folder, name)))
    return out


def _read_shard(path: str) -> dict[str, tuple[int, float]]:
    try:
        doc = _load_json(path)
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out = {}
    for key, value in doc.items():
        if (
            isinstance(value, list)
            and len(value) == 2
            and _is_counts({"h": value[0], "s": value[1]})
        ):
            out[key] = (int(value[0]), float(value[1]))
    return out


def _key_shard(key: str) -> str:
    return "%02x" % (xxhash.xxh32_intdigest(key.encode()) % KEY_SHARDS)


@contextlib.contextmanager
def _locked(cache_dir: str, create: bool) -> Iterator[str]:
    """Hold the stats lock; yields the stats folder.

    Only ``v1/stats`` is created, and only inside an existing cache directory:
    a process flushing at exit must not resurrect a directory the user just removed.
    """
    if getattr(_inside, "lock", False):
        # A finalizer (a Cache collected mid-merge) flushing on the thread that
        # holds the lock: a second flock on a new descriptor would wait for
        # ourselves forever. The caller counts the lost batch.
        raise OSError(errno.EDEADLK, "statistics merge re-entered on the same thread")
    folder = stats_dir(cache_dir)
    if create and os.path.isdir(cache_dir):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    fd = open_lock_fd(os.path.join(folder, "lock"))  # closed in forked children
    if not lock_within(fd, LOCK_WAIT):  # fd is no longer ours
        raise TimeoutError(errno.ETIMEDOUT, f"statistics lock held for {LOCK_WAIT:g} s")
    try:
        _inside.lock = True
        try:
            yield folder
        finally:
            _inside.lock = False
    finally:
        close_lock_fd(fd)


_inside = threading.local()
#: Seconds a flush waits for another process's merge: on a network filesystem at 2 ms
#: per request, eight processes queueing for it stalled a caller 14 s (issue 40). A
#: flush that gives up keeps its counts for the next one (:class:`.recorder.Recorder`).
LOCK_WAIT = 1.0


def _write_json(path: str, doc: object) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            # Damage a rename cannot replace: it is our file's name, so it goes.
            shutil.rmtree(path, ignore_errors=True)
    _fs.write_atomic(path, json.dumps(doc, separators=(",", ":")).encode())


def _add(counts: dict[str, Any], deltas: Mapping[str, float]) -> None:
    # Zeros too: a counter a tier keeps shows in reports as 0, not as missing.
    for name, value in deltas.items():
        counts[name] = counts.get(name, 0) + value


def merge(
    cache_dir: str,
    tiers: Mapping[str, Mapping[str, float]],
    compile_counts: Mapping[str, float],
    keys: KeyDeltas,
    families: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """Add one process's deltas to the shared totals (raises ``OSError`` on I/O failure)."""
    with _locked(cache_dir, create=True) as folder:
        path = os.path.join(folder, "totals.json")
        totals = read_totals(cache_dir)
        if totals.pop("damaged", False):
            # Kept for a look if it can be (a directory cannot replace a file
            # there); _write_json replaces it either way.
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
                os.replace(path, path + ".corrupt")
        for section in (totals["lifetime"], totals["period"]):
            for name, deltas in tiers.items():
                _add(section["tiers"].setdefault(name, {}), deltas)
            _add(section["compile"], compile_counts)
            for name, deltas in (families or {}).items():
                _add(section.setdefault("families", {}).setdefault(name, {}), deltas)
        _add_day(totals, tiers, compile_counts)
        _write_json(path, totals)
        if keys:
            _merge_keys(folder, keys)


def _add_day(
    totals: dict[str, Any],
    tiers: Mapping[str, Mapping[str, float]],
    compile_counts: Mapping[str, float],
) -> None:
    """Today's seconds saved, hits and compiles (the date as this machine says it)."""
    deltas = {
        "seconds_saved": sum(t.get("seconds_saved", 0) for t in tiers.values()),
        "hits": sum(t.get("hits", 0) for t in tiers.values()),
        "compiles": compile_counts.get("compiles", 0),
    }
    if not any(deltas.values()):
        return
    days = totals.setdefault("days", {})
    _add(days.setdefault(time.strftime("%Y-%m-%d"), {}), deltas)
    for old in sorted(days)[:-MAX_DAYS]:
        del days[old]


def _merge_keys(folder: str, keys: KeyDeltas) -> None:
    shards: dict[str, list[tuple[str, tuple[int, float]]]] = {}
    for key, delta in keys.items():
        shards.setdefault(_key_shard(key), []).append((key, delta))
    with contextlib.suppress(FileExistsError):
        os.mkdir(os.path.join(folder, "keys"), 0o700)
    for shard, items in shards.items():
        path = os.path.join(folder, "keys", f"{shard}.json")
        doc = _read_shard(path)
        for key, (hits, saved) in items:
            old_hits, old_saved = doc.get(key, (0, 0.0))
            doc[key] = (old_hits + hits, old_saved + saved)
        _write_json(path, {k: list(v) for k, v in doc.items()})


def zero_period(cache_dir: str) -> bool:
    """Start a new period; lifetime totals stay. ``False`` if the cache has no directory."""
    if not os.path.isdir(cache_dir):
        return False
    with _locked(cache_dir, create=True) as folder:
        totals = read_totals(cache_dir)
        totals.pop("damaged", None)
        totals["period"] = new_section()
        _write_json(os.path.join(folder, "totals.json"), totals)
    return True


def forget_keys(cache_dir: str, keep: set[str] | None = None) -> None:
    """Drop per-key hit counts of keys not in ``keep`` (all of them when ``None``)."""
    folder = stats_dir(cache_dir)
    if not os.path.isdir(os.path.join(folder, "keys")):
        return
    with _locked(cache_dir, create=False):
        for name in os.listdir(os.path.join(folder, "keys")):
            path = os.path.join(folder, "keys", name)
            if keep is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            doc = _read_shard(path)
            kept = {k: list(v) for k, v in doc.items() if k in keep}
            if len(kept) != len(doc):
                _write_json(path, kept)
