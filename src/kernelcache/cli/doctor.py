"""``kernelcache doctor [--json]``: one line per check, OK or the problem and its fix."""

from __future__ import annotations

import argparse
import os

from kernelcache.cli.output import print_json
from kernelcache.doctor import Check, run, summary

_MARK = {"ok": "OK", "note": "NOTE", "problem": "PROBLEM"}


def cmd_doctor(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.dir is not None:  # as every command: --dir wins over KERNELCACHE_DIR
        env["KERNELCACHE_DIR"] = os.path.abspath(os.path.expanduser(args.dir))
    checks = run(env)
    if args.json:
        print_json(summary(checks))
    else:
        print(render(checks))
    return 0 if summary(checks)["ok"] else 1


def render(checks: list[Check]) -> str:
    width = max(len(f"{c.area}: {c.name}") for c in checks)
    lines = []
    for check in checks:
        line = f"{_MARK[check.status]:<8} {f'{check.area}: {check.name}':<{width}}  {check.detail}"
        if check.fix:
            line += f"\n{'':<8} {'':<{width}}  fix: {check.fix}"
        lines.append(line)
    problems = sum(c.status == "problem" for c in checks)
    lines.append(f"{problems} problem{'s' if problems != 1 else ''}" if problems else "all OK")
    return "\n".join(lines)
