"""``kernelcache server status|stop``: the nvcc launcher's server, seen and stopped.

Like ``sccache --show-stats`` / ``--stop-server``: one server runs per user and
cache directory (:mod:`kernelcache.nvcc.server`); ``status`` says whether it
runs, its pid, socket, log and idle timeout; ``stop`` ends it (the next
launcher call starts a new one).
"""

from __future__ import annotations

import argparse
import os

from kernelcache.cli.output import print_json, table
from kernelcache.nvcc import control
from kernelcache.nvcc.client import SOCKET
from kernelcache.settings import Settings


def status(directory: str) -> dict[str, object]:
    """What ``kernelcache server status --json`` prints."""
    found = control.running(directory)
    return {
        "dir": directory,
        "running": found is not None,
        "pid": found[0] if found else None,
        "idle_timeout": found[1] if found else None,
        "socket": os.path.join(directory, os.fsdecode(SOCKET)),
        "log": os.path.join(directory, control.LOG),
        # What the next server started from this environment would use.
        "idle_timeout_configured": control.idle_seconds(os.environ),
    }


def cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    directory = settings.dir
    if args.action == "stop":
        before = control.running(directory)
        stopped = control.stop(directory)
        if args.json:
            print_json({"dir": directory, "stopped": stopped, "pid": before[0] if before else None})
        elif stopped and before:
            print(f"stopped the launcher server of {directory} (pid {before[0]})")
        else:
            print(f"no launcher server runs for {directory}")
        return 0
    report = status(directory)
    if args.json:
        print_json(report)
        return 0
    idle = report["idle_timeout"] if report["running"] else report["idle_timeout_configured"]
    rows = [
        ("directory", directory),
        ("running", f"yes, pid {report['pid']}" if report["running"] else "no"),
        ("socket", report["socket"]),
        ("idle timeout", f"{idle} s" if idle is not None else "unknown (an older server)"),
        ("log", report["log"]),
    ]
    print(table(("SERVER", "VALUE"), rows))
    return 0
