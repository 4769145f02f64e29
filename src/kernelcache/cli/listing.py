"""``kernelcache ls``, ``show`` and ``config``: looking at the cache without changing it."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import xxhash

from kernelcache import maintenance
from kernelcache.cache import Cache
from kernelcache.cli.common import named, open_cache, require_cache
from kernelcache.cli.output import format_age, format_seconds, format_time, print_json, table
from kernelcache.errors import ConfigError, CorruptEntry, StoreError
from kernelcache.keys import family
from kernelcache.settings import Settings
from kernelcache.stats.totals import read_key_hits
from kernelcache.stores.base import Store
from kernelcache.units import format_size


def _key_hits(cache: Cache) -> dict[str, tuple[int, float]]:
    return read_key_hits(cache.stats_dir) if cache.stats_dir is not None else {}


def _kind(tier: Store, key: str) -> str | None:
    """The integration an entry belongs to (``nvcc``, ``jax``, ``inductor``...), from the key
    record stored with it; ``None`` on a shared tier (one request per entry is too many for a
    listing) or for an entry stored before records were kept."""
    if tier.shared:
        return None
    try:
        entry = tier.get(key)  # the command's tiers are read-only: no access time changes
        record = entry.key_record if entry is not None else None
    except (StoreError, CorruptEntry):
        return None  # `kernelcache verify` reports it
    namespace = record.get("ns") if record is not None else None
    return family(namespace) if isinstance(namespace, str) else None


def cmd_ls(args: argparse.Namespace, settings: Settings) -> int:
    require_cache(settings, remote=True)
    with open_cache(settings, write=False) as cache:
        hits = _key_hits(cache)
        names = {id(tier): name for name, tier in named(cache.tiers)}
        rows: list[dict[str, Any]] = []
        for tier, info in maintenance.entries(cache.tiers):
            count, saved = hits.get(info.key, (0, 0.0))
            rows.append(
                {
                    "key": info.key,
                    "kind": _kind(tier, info.key),
                    "tier": names[id(tier)],
                    "size": info.size,
                    "last_access": info.last_access,
                    "created": info.created,
                    "hits": count,
                    "seconds_saved": saved,
                }
            )
    order = {"size": "size", "hits": "hits", "age": "last_access"}[args.sort]
    rows.sort(key=lambda r: (r[order], r["key"]), reverse=args.sort != "age")
    if args.json:
        print_json(rows)
        return 0
    now = time.time()
    print(
        table(
            ("KEY", "KIND", "SIZE", "LAST USED", "HITS", "SAVED", "TIER"),
            [
                (
                    r["key"],
                    r["kind"] or "-",
                    format_size(r["size"]),
                    format_age(now - r["last_access"]) + " ago",
                    r["hits"],
                    format_seconds(r["seconds_saved"]),
                    r["tier"],
                )
                for r in rows
            ],
            right=(2, 3, 4, 5),
        )
    )
    return 0


def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    require_cache(settings, remote=True)
    with open_cache(settings, write=False) as cache:
        try:
            found = maintenance.find(cache.tiers, args.key)
        except ValueError as exc:  # not a valid key
            raise ConfigError(str(exc)) from None
        entry = found[0].get(args.key) if found is not None else None
        hits, saved = _key_hits(cache).get(args.key, (0, 0.0))
        tier_name = (
            dict((id(t), n) for n, t in named(cache.tiers)).get(id(found[0])) if found else None
        )
    if found is None or entry is None:
        state = "is damaged (run `kernelcache verify --fix`)" if found else "is not in the cache"
        print(f"kernelcache: entry {args.key} {state}", file=sys.stderr)
        return 1
    info = found[1]
    artifacts = [
        {"name": name, "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
        for name, data in entry.items()
    ]
    report = {
        "key": args.key,
        "tier": tier_name,
        "size": info.size,
        "last_access": info.last_access,
        "created": info.created,
        "hits": hits,
        "seconds_saved": saved,
        "meta": entry.meta,
        "artifacts": artifacts,
    }
    if args.json:
        print_json(report)
        return 0
    fields = [
        ("key", args.key),
        ("tier", tier_name),
        ("file size", info.size),
        ("last used", format_time(info.last_access)),
        ("created", format_time(info.created)),
        ("hits", f"{hits} (saved {saved:.2f} s)"),
    ]
    print(table(("FIELD", "VALUE"), fields))
    print("\nmeta")
    print(table(("NAME", "VALUE"), sorted((k, repr(v)) for k, v in entry.meta.items())))
    print("\nartifacts")
    print(
        table(
            ("NAME", "SIZE", "XXH3-128"),
            [(a["name"], a["size"], a["xxh3_128"]) for a in artifacts],
            right=(1,),
        )
    )
    return 0
