"""``kernelcache explain``: why a key missed, field by field (issue 38).

``explain KEY`` compares the entry stored under ``KEY`` with its nearest
neighbours; ``explain --last-miss KIND`` does the same for the last compile
of an integration family (filed by :mod:`kernelcache.explain.record`, in any
process); ``explain -- nvcc ARGS...`` tells, without compiling, whether the
launcher would hit, miss (and why) or not cache that command line, with the
launcher's own parse, keys and lookup.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kernelcache._trust import UntrustedDirectory
from kernelcache.cli.common import open_cache
from kernelcache.cli.output import format_time, print_json
from kernelcache.errors import ConfigError
from kernelcache.explain.nearest import nearest, stored_record
from kernelcache.explain.record import last_miss
from kernelcache.settings import Settings
from kernelcache.stores.base import is_valid_key


def cmd_explain(args: argparse.Namespace, settings: Settings) -> int:
    what = list(args.what or [])
    if args.last_miss is not None:
        if what:
            raise ConfigError("give --last-miss KIND or a KEY, not both")
        report = _last_miss(settings, args.last_miss)
    elif len(what) == 1 and is_valid_key(what[0]) and not what[0].endswith("nvcc"):
        report = _key(settings, what[0])
    elif what:
        report = _command(settings, what)
    else:
        raise ConfigError(
            "say what to explain: a KEY, --last-miss KIND, or -- nvcc ARGS... (a launcher command)"
        )
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0 if report.get("status") != "unknown" else 1


def _last_miss(settings: Settings, kind: str) -> dict[str, Any]:
    try:
        record = last_miss(settings.dir, kind)
    except (ValueError, UntrustedDirectory) as exc:
        raise ConfigError(str(exc)) from None
    if record is None:
        return {
            "status": "unknown",
            "kind": kind,
            "message": f"no miss of {kind} recorded in {settings.dir} yet",
        }
    with open_cache(settings, write=False) as cache:
        near = nearest(cache.tiers, record)
    return {"status": "miss", "kind": kind, "subject": record, "nearest": near}


def _key(settings: Settings, key: str) -> dict[str, Any]:
    with open_cache(settings, write=False) as cache:
        record = stored_record(cache.tiers, key)
        if record is None:
            return {
                "status": "unknown",
                "key": key,
                "message": f"no entry with its key's fields under {key} "
                "(stored before keys explained themselves, or not stored)",
            }
        return {"status": "stored", "subject": record, "nearest": nearest(cache.tiers, record)}


def _command(settings: Settings, argv: list[str]) -> dict[str, Any]:
    """What the launcher would do with ``argv`` (``nvcc ARGS...``), compiling nothing."""
    from kernelcache.explain.fields import summary
    from kernelcache.nvcc.args import parse
    from kernelcache.nvcc.job import Job, lookup
    from kernelcache.nvcc.key import resolve_compiler

    env = os.environ
    nvcc = resolve_compiler(argv[0], env)
    inv = parse(list(argv[1:]), env)
    if inv.reason is not None:
        return {"status": "uncacheable", "reason": inv.reason}
    try:
        job = Job.prepare(nvcc, inv, env)
    except OSError as exc:
        return {"status": "uncacheable", "reason": f"cannot read input ({exc})"}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    with open_cache(settings, write=False) as cache:
        if lookup(cache.get, job) is not None:
            return {"status": "hit", "key": job.direct}
        record = {"key": job.direct, "name": None, **(summary(job.direct) or {})}
        changed = _changed_inputs(cache.get(job.direct), job.basedir)
        if changed is not None:
            return {"status": "miss", "subject": record, "inputs": changed, "nearest": []}
        return {"status": "miss", "subject": record, "nearest": nearest(cache.tiers, record)}


def _changed_inputs(manifest: Any, basedir: str | None) -> list[dict[str, Any]] | None:
    """For a command and source stored before: the files that differ from the nearest
    recorded variant (in words), or ``None`` when nothing is stored for them."""
    from kernelcache.explain.words import differences
    from kernelcache.keys import file_sha256
    from kernelcache.nvcc import deps

    variants = deps.variants(manifest)
    if not variants:
        return None
    best: list[dict[str, Any]] | None = None
    for variant in variants:
        then, now = [], []
        for stored, digest, _sig in variant.get("deps", []):
            path = deps.resolve(str(stored), basedir)
            try:
                current = file_sha256(path) if path is not None else "missing"
            except OSError:
                current = "missing"
            label = f"input[{stored}]"
            then.append([label, str(digest)[:12]])
            now.append([label, current[:12]])
        found = differences({"fields": now}, {"fields": then})
        if best is None or len(found) < len(best):
            best = found
    return best


def render(report: dict[str, Any]) -> str:
    """A report as text, one difference a line."""
    status = report["status"]
    if status == "unknown":
        return str(report["message"])
    if status == "hit":
        return f"would hit (key {report['key'][:16]})"
    if status == "uncacheable":
        return f"would not be cached: {report['reason']}"
    subject = report["subject"]
    lines = []
    if "kind" in report:
        when = format_time(subject["when"]) if isinstance(subject.get("when"), float) else "?"
        lines.append(f"last miss of {report['kind']}: key {subject['key'][:16]}, {when}")
    elif status == "miss":
        lines.append(f"would miss (key {subject['key'][:16]})")
    else:
        lines.append(f"entry {subject['key'][:16]} ({subject.get('ns')})")
    if "inputs" in report:
        lines.append("stored for this command and source, with other inputs:")
        lines.extend(f"  - {d['words']}" for d in report["inputs"])
        return "\n".join(lines)
    if not report["nearest"]:
        lines.append(f"no other stored entry of {subject.get('ns')} to compare with")
    for other in report["nearest"]:
        count = other["differing"]
        lines.append(
            f"nearest: {other['key'][:16]}"
            + (f" ({other['name']})" if other.get("name") else "")
            + f", {count} field{'s' if count != 1 else ''} differ{'s' if count == 1 else ''}:"
        )
        lines.extend(f"  - {d['words']}" for d in other["differences"])
    return "\n".join(lines)
