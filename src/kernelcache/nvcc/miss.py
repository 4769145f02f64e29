"""A direct-mode miss: try the preprocessed key, else run nvcc, pass its results through, cache them.

1. nvcc's own preprocessing gives the *preprocessed key*
   (:mod:`kernelcache.nvcc.preprocess`), unless no result of this command was
   ever stored under one (no mark under :func:`kernelcache.nvcc.key.seen_key`):
   then nvcc compiles at once with ``--keep`` and the key is taken from the
   files its own preprocessing passes left, with no pass run twice. A result stored under it (the same
   compile before a comment-only edit) is restored, and the manifest under the
   direct key gains a variant for today's dependencies.
2. Otherwise nvcc compiles. The result is stored under the preprocessed key
   (or, for a source nvcc does not preprocess, the direct key plus the content
   of every dependency) and added as a variant to the manifest.

Not cached: failed compiles, compiles whose inputs changed while they ran, and
sources that use a time macro (unless ``KERNELCACHE_SLOPPINESS=time_macros``).
A dependency whose include directives the scanner cannot read exactly
(:class:`kernelcache.nvcc.includes.Unsure`) gets no manifest variant: its
result is found by the preprocessed key only (and not cached without one).
Imported only on a miss, with ``subprocess`` and ``tempfile``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING

from kernelcache.explain import note_inputs
from kernelcache.nvcc import deps as nvcc_deps
from kernelcache.nvcc import includes
from kernelcache.nvcc import key as nvcc_key
from kernelcache.nvcc.job import Job, Outcome, lookup, saved_seconds
from kernelcache.nvcc.outputs import (
    MESSAGES_META,
    messages,
    pack_output,
    replay,
    stored_messages,
    write_outputs,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from kernelcache.cache import Cache
    from kernelcache.entry import Entry

#: The result's meta field listing its dependencies (paths as keyed), so that a
#: preprocessed hit can record today's state of the same files.
DEPS_META = "deps"


def handle(
    cache: Cache, job: Job, on_start: Callable[[], None] | None = None
) -> tuple[int, Outcome]:
    """The exit code and outcome of a call whose direct lookup missed.

    Run under the command's flight claim (:mod:`kernelcache.nvcc.flight`): a
    caller that waited for another's compile finds its result here.
    ``on_start`` is called once nvcc runs, if it does (the launcher starts its
    server then: off the compile's critical path).
    """
    from kernelcache.nvcc import flight

    with flight.claim(cache, job.direct, job.env):
        hit = lookup(cache.get, job)
        if hit is not None and write_outputs(job.inv, hit[1], job.basedir):
            replay(*messages(hit[1], job.basedir))
            return 0, Outcome("hits", saved=saved_seconds(hit[1]), detail="flight_hits")
        return _handle(cache, job, on_start)


def _handle(cache: Cache, job: Job, on_start: Callable[[], None] | None) -> tuple[int, Outcome]:
    started = time.time_ns()  # before preprocessing: an edit after it is a race
    pre = None
    if nvcc_key.flag(job.env, "KERNELCACHE_NVCC_PREPROCESSED", True):
        from kernelcache.nvcc import preprocess

        if cache.get(nvcc_key.seen_key(job.command)) is None:
            # No result of this command was ever stored under a preprocessed
            # key, so none can be found: compile at once, and take the key
            # from the preprocessed files the compile itself leaves behind.
            return _compile(cache, job, None, started, learn=True, on_start=on_start)

        digests = preprocess.digests(job.nvcc, job.inv, job.env, job.basedir)
        pre = nvcc_key.preprocessed_key(job.command, digests) if digests else None
    if pre is not None:
        restored = preprocessed_lookup(cache, job, pre, started)
        if restored is not None:
            result, outcome = restored
            replay(*messages(result, job.basedir))
            return 0, outcome
    return _compile(cache, job, pre, started, on_start=on_start)


def preprocessed_lookup(
    cache: Cache, job: Job, pre: str, started: int
) -> tuple[Entry, Outcome] | None:
    """The result stored under the preprocessed key ``pre``, restored (its outputs written,
    today's dependencies remembered), and its outcome; ``None`` if there is none to use.
    Its stdout and stderr are the caller's to pass on (a process of its own, or the
    launcher server's client)."""
    found = cache.get(pre)
    if found is None:
        return None
    outcome = _preprocessed_hit(cache, job, pre, found, started)
    return None if outcome is None else (found, outcome)


def _preprocessed_hit(
    cache: Cache, job: Job, pre: str, result: Entry, started: int
) -> Outcome | None:
    """Restore a result found under the preprocessed key and remember today's dependencies."""
    stored = result.meta.get(DEPS_META)
    if not isinstance(stored, list):
        return None
    paths = [nvcc_deps.resolve(str(p), job.basedir) for p in stored]
    if None in paths:
        return None
    try:
        recorded = _record([p for p in paths if p is not None], job, started)
    except OSError:
        return None
    if isinstance(recorded, str) or not write_outputs(job.inv, result, job.basedir):
        return None
    if recorded[1] is not None:
        _add_variant(cache, job, recorded, pre)
    return Outcome("hits", saved=saved_seconds(result), detail="preprocessed_hits")


def _compile(
    cache: Cache,
    job: Job,
    pre: str | None,
    started: int,
    learn: bool = False,
    on_start: Callable[[], None] | None = None,
) -> tuple[int, Outcome]:
    """Run nvcc and cache its result; ``learn``: the preprocessed key comes from its kept files."""
    import shutil
    import subprocess
    import tempfile

    inv = job.inv
    fd, own_dep = tempfile.mkstemp(prefix="kernelcache-", suffix=".d")
    os.close(fd)
    keep_dir = tempfile.mkdtemp(prefix="kernelcache-") if learn else None
    try:
        # Without a user -MD, nvcc writes its dependency list for us in the same
        # run: no separate preprocessor pass (the output is unchanged by -MD).
        extra = ["-MD", "-MF", own_dep] if inv.depmode is None else []
        if keep_dir is not None:
            extra += ["--keep", "--keep-dir", keep_dir]
        began = time.time_ns()
        try:
            proc = subprocess.Popen(
                [job.nvcc, *job.args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except OSError as exc:
            print(f"kernelcache: cannot run {job.nvcc}: {exc}", file=sys.stderr)
            return 127, Outcome("failed")
        if on_start is not None:
            on_start()  # while nvcc works
        with proc:
            # Which kept files its passes write: asked while it compiles.
            kept = _plan_keep(job, keep_dir) if keep_dir is not None else None
            stdout, stderr = proc.communicate()
        elapsed = (time.time_ns() - began) / 1e9
        replay(stdout, stderr)
        if proc.returncode != 0:
            return proc.returncode, Outcome("failed")
        return 0, finish(cache, job, pre, kept, (stdout, stderr, elapsed), own_dep, started)
    finally:
        os.unlink(own_dep)
        if keep_dir is not None:
            shutil.rmtree(keep_dir, ignore_errors=True)


def finish(
    cache: Cache,
    job: Job,
    pre: str | None,
    kept: list[str] | None,
    run: tuple[bytes, bytes, float],
    own_dep: str,
    started: int,
) -> Outcome:
    """Cache a successful compile (``run``: its stdout, stderr and seconds) and say how it went.

    ``kept``: the files its preprocessing passes left (``--keep``), which give
    the preprocessed key; the command is then marked as stored under one.
    """
    if kept is not None:
        pre = _kept_key(job, kept)
    why = _store(cache, job, pre, run, own_dep, started)
    if why is None and kept is not None and pre is not None:
        from kernelcache.entry import Entry

        cache.put(nvcc_key.seen_key(job.command), Entry({}))
    return Outcome("misses") if why is None else Outcome("uncacheable", reason=why)


def _plan_keep(job: Job, keep_dir: str) -> list[str] | None:
    from kernelcache.nvcc import preprocess

    return preprocess.kept_files(job.nvcc, job.args, keep_dir, job.env)


def _kept_key(job: Job, kept: list[str]) -> str | None:
    """The preprocessed key from the files a ``--keep`` compile left, or ``None``."""
    from kernelcache.nvcc import preprocess

    digests = []
    for path in kept:
        try:
            with open(path, "rb") as f:
                digests.append(preprocess.hash_output(f.read(), job.basedir))
        except OSError:
            return None
    return nvcc_key.preprocessed_key(job.command, digests)


def _record(paths: list[str], job: Job, started: int) -> tuple[Any, Any] | str:
    """``(rows, absent groups)`` of a compile's dependencies, or why it cannot be cached.

    The absent groups are ``None`` when the include scan is unsure: no direct mode.
    """
    recorded = nvcc_deps.record(paths, job.basedir, started)
    if recorded is None:
        return "an input changed during the compile"
    rows, contents = recorded
    if "time_macros" not in job.sloppy:
        why = includes.time_macro(contents)
        if why is not None:
            return f"uses {why.split(' in ', 1)[0]}"
    try:
        absent = includes.absent(contents, job.search_path(), started)
    except includes.Unsure:
        return rows, None  # only the preprocessed key can find this result
    if absent is None:
        return "an input changed during the compile"
    return rows, includes.watch(absent, job.basedir)


def _store(
    cache: Cache,
    job: Job,
    pre: str | None,
    run: tuple[bytes, bytes, float],
    own_dep: str,
    started: int,
) -> str | None:
    """Cache a successful compile; returns why it was not cached, or ``None``."""
    from kernelcache.entry import Entry

    inv = job.inv
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
            full = _system_deps(job)
        else:
            full = user_dep or b""
        paths = nvcc_deps.parse_depfile(full)[1]
        recorded = _record(paths, job, started)
    except (OSError, ValueError) as exc:
        return f"outputs or dependencies unreadable ({type(exc).__name__})"
    if isinstance(recorded, str):
        return recorded
    if recorded[1] is None and pre is None:
        return "include directives the scanner cannot follow, and no preprocessed key"
    stored, encoding = pack_output(output)
    stdout, stderr, elapsed = run
    folder = job.folder if job.folder and nvcc_key.names_folder(output, job.folder) else None
    shared = job.folder is not None and folder is None  # served in other folders too
    stdout, stderr = stored_messages(stdout, stderr, job.folder if shared else None)
    artifacts = {"output": stored, "stdout": stdout, "stderr": stderr}
    if user_dep is not None:
        body = user_dep if inv.deptarget else nvcc_deps.strip_target(user_dep, inv.target)
        if body is None:
            return "dependency file does not start with the output name"
        artifacts["depfile"] = nvcc_deps.to_stored(body, job.basedir)
    meta: dict[str, object] = {
        "compile_seconds": round(elapsed, 6),
        "explicit_target": inv.deptarget,
        DEPS_META: [row[0] for row in recorded[0]],
        **encoding,
    }
    if shared:
        meta[MESSAGES_META] = True
    result = pre if pre is not None else nvcc_key.result_key(job.direct, recorded[0])
    if folder is not None:  # served in this folder only, never under the shared keys
        result, meta["folder"] = nvcc_key.pinned_key(result, folder), folder
    note_inputs(result, {row[0]: row[1] for row in recorded[0]}, covers=("preprocessed", "deps"))
    cache.put(result, Entry(artifacts, meta))
    if recorded[1] is not None:
        _add_variant(cache, job, recorded, result, folder)
    return None


def _add_variant(
    cache: Cache, job: Job, recorded: tuple[Any, Any], result: str, folder: str | None = None
) -> None:
    from kernelcache.entry import Entry

    rows, absent = recorded
    known = nvcc_deps.variants(cache.get(job.direct))
    variants = nvcc_deps.add_variant(known, rows, absent, result, folder)
    cache.put(job.direct, Entry({nvcc_deps.MANIFEST: json.dumps(variants).encode()}))


def _system_deps(job: Job) -> bytes:
    """Full dependencies for an ``-MMD`` compile, whose own file omits system headers."""
    import subprocess

    from kernelcache.nvcc.args import dependency_only

    proc = subprocess.run(
        [job.nvcc, *dependency_only(job.args)], capture_output=True, env=dict(job.env), check=False
    )
    if proc.returncode != 0:
        raise ValueError("nvcc -M failed")
    return bytes(proc.stdout)
