"""A launcher miss: run nvcc, pass its results through, and cache them.

The result is stored under the *result key* (the direct key plus the content
of every dependency nvcc reported) and added as a variant to the manifest
under the direct key (:mod:`kernelcache.nvcc.deps`). Imported only on a miss,
with ``subprocess`` and ``tempfile``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kernelcache.nvcc import deps as nvcc_deps
from kernelcache.nvcc.outputs import replay
from kernelcache.stats.launcher import count

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from kernelcache.cache import Cache
    from kernelcache.nvcc.args import Invocation
    from kernelcache.settings import Settings


def compile_and_cache(
    cache: Cache,
    settings: Settings,
    nvcc: str,
    args: list[str],
    inv: Invocation,
    direct: str,
    basedir: str | None,
) -> int:
    """Run nvcc on a miss, pass its results through, and cache them if nothing raced."""
    import subprocess
    import tempfile

    fd, own_dep = tempfile.mkstemp(prefix="kernelcache-", suffix=".d")
    os.close(fd)
    try:
        # Without a user -MD, nvcc writes its dependency list for us in the same
        # run: no separate preprocessor pass (the output is unchanged by -MD).
        extra = ["-MD", "-MF", own_dep] if inv.depmode is None else []
        started = time.time_ns()
        try:
            proc = subprocess.run([nvcc, *args, *extra], capture_output=True, check=False)
        except OSError as exc:
            print(f"kernelcache: cannot run {nvcc}: {exc}", file=sys.stderr)
            return 127
        elapsed = (time.time_ns() - started) / 1e9
        replay(proc.stdout, proc.stderr)
        if proc.returncode != 0:
            count(settings, "failed")
            return proc.returncode
        why = _store(cache, nvcc, args, inv, direct, basedir, proc, own_dep, started, elapsed)
        count(settings, "misses" if why is None else "uncacheable", reason=why)
        return 0
    finally:
        os.unlink(own_dep)


def _store(
    cache: Cache,
    nvcc: str,
    args: list[str],
    inv: Invocation,
    direct: str,
    basedir: str | None,
    proc: Any,
    own_dep: str,
    started: int,
    elapsed: float,
) -> str | None:
    """Cache a successful compile; returns why it was not cached, or ``None``."""
    from kernelcache.entry import Entry

    try:
        with open(inv.output or "", "rb") as f:
            output = f.read()
        user_dep = None
        if inv.depfile is not None:
            with open(inv.depfile, "rb") as f:
                user_dep = f.read()
        if inv.depmode is None:
            with open(own_dep, "rb") as f:
                full = f.read()
        elif inv.depmode == "-MMD":
            full = _system_deps(nvcc, args)
        else:
            full = user_dep or b""
        rows = nvcc_deps.record(nvcc_deps.parse_depfile(full)[1], basedir, started)
    except (OSError, ValueError) as exc:
        return f"outputs or dependencies unreadable ({type(exc).__name__})"
    if rows is None:
        return "an input changed during the compile"
    artifacts = {"output": output, "stdout": proc.stdout, "stderr": proc.stderr}
    if user_dep is not None:
        body = user_dep if inv.deptarget else nvcc_deps.strip_target(user_dep, inv.output or "")
        if body is None:
            return "dependency file does not start with the output name"
        artifacts["depfile"] = nvcc_deps.to_stored(body, basedir)
    meta = {"compile_seconds": round(elapsed, 6), "explicit_target": inv.deptarget}
    result = result_key(direct, rows)
    cache.put(result, Entry(artifacts, meta))
    variants = nvcc_deps.add_variant(nvcc_deps.variants(cache.get(direct)), rows, result)
    cache.put(direct, Entry({nvcc_deps.MANIFEST: json.dumps(variants).encode()}))
    return None


def _system_deps(nvcc: str, args: list[str]) -> bytes:
    """Full dependencies for an ``-MMD`` compile, whose own file omits system headers."""
    import subprocess

    from kernelcache.nvcc.args import dependency_only

    proc = subprocess.run([nvcc, *dependency_only(args)], capture_output=True, check=False)
    if proc.returncode != 0:
        raise ValueError("nvcc -M failed")
    return bytes(proc.stdout)


def result_key(direct: str, rows: list[list[Any]]) -> str:
    from kernelcache.keys import KeyBuilder

    return (
        KeyBuilder("kernelcache.nvcc.result")
        .add("direct", direct)
        .add("deps", nvcc_deps.result_rows(rows))
        .hexdigest()
    )
