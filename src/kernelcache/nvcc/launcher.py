"""``kernelcache nvcc ARGS...``: a caching compiler launcher, like ccache for nvcc.

Usable by hand (``kernelcache nvcc -c k.cu -o k.o``) and as
``CMAKE_CUDA_COMPILER_LAUNCHER=kernelcache`` (CMake then runs
``kernelcache /path/to/nvcc ARGS...``). Which command lines are cached is
said in :mod:`kernelcache.nvcc.args`; anything else runs nvcc unchanged and
is counted as uncacheable with its reason.

A call goes first to the launcher's server (:mod:`kernelcache.nvcc.client`,
:mod:`kernelcache.nvcc.server`), which answers hits without a new Python
process importing anything. Everything else, and every call when no server
can answer, runs here, in the calling process (:func:`main`):

- the *direct* lookup: the manifest under the direct key
  (:mod:`kernelcache.nvcc.key`) maps dependency states to results, so a hit
  costs one ``stat`` per dependency and no preprocessor run;
- on a direct miss, the *preprocessed* lookup and the compile
  (:mod:`kernelcache.nvcc.miss`).

A hit writes the output and dependency file byte-identical to what nvcc
wrote on the miss (the dependency file's default target is rewritten to this
call's) and replays nvcc's stdout and stderr. Failed compiles pass through
and are not cached. Every call is counted once (:class:`~kernelcache.nvcc.job.Outcome`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if __name__ == "__main__":
    # The client's way in when the server gave no hit: a first compile goes
    # through the warm server before this process imports the cache.
    from kernelcache.nvcc import compiling

    compiling.main(sys.argv[1:])  # exits when it did the call

from kernelcache.nvcc.args import parse
from kernelcache.nvcc.job import Job, Outcome, lookup, saved_seconds
from kernelcache.nvcc.key import ENV_VARS, host_compiler, resolve_compiler
from kernelcache.nvcc.outputs import messages, replay, write_outputs
from kernelcache.stats.launcher import STATS_FILE, launcher_stats, stats_path

if TYPE_CHECKING:
    from collections.abc import Callable

    from kernelcache.cache import Cache
    from kernelcache.nvcc.args import Invocation
    from kernelcache.settings import Settings

# The statistics names stay importable from here (the CLI and tests use them).
__all__ = [
    "ENV_VARS",
    "STATS_FILE",
    "forget",
    "host_compiler",
    "launcher_stats",
    "main",
    "run_plain",
    "stats_path",
]

USAGE = "usage: kernelcache nvcc ARGS...  |  kernelcache /path/to/nvcc ARGS..."


def main(argv: list[str]) -> int:
    """Run ``argv`` (``["nvcc" or "/path/to/nvcc", args...]``) through the cache, in this process."""
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    env = os.environ
    nvcc = resolve_compiler(argv[0], env)
    args = list(argv[1:])
    inv = parse(args, env)
    from kernelcache.errors import KernelCacheError
    from kernelcache.settings import Settings

    try:
        settings = Settings.load()
    except (KernelCacheError, OSError) as exc:
        return _without_cache(nvcc, args, exc)
    if settings.disable:
        return run_plain(nvcc, args)
    wake = _Wake(settings)
    rc, outcome = _run(settings, nvcc, inv, wake)
    wake()  # a hit, an uncacheable call: once its work is done
    if outcome is not None:
        outcome.record(settings)
    return rc


class _Wake:
    """Start the server for the next calls, once: as soon as this call's nvcc runs
    (:func:`kernelcache.nvcc.miss.handle`), else when the call is done.

    Only later calls use a server, so a first miss into an empty cache directory
    does not start one before its own compile does (issue 40: a fresh CI runner's
    first build); it starts it while nvcc works.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if not self._settings.read_only:  # read-only writes nothing, and a server would
            from kernelcache.nvcc import spawn

            spawn.wake(self._settings.dir, os.environ)


def _run(
    settings: Settings, nvcc: str, inv: Invocation, wake: Callable[[], None]
) -> tuple[int, Outcome | None]:
    if inv.reason is not None:
        return run_plain(nvcc, inv.args), Outcome("uncacheable", reason=inv.reason)
    try:
        job = Job.prepare(nvcc, inv, os.environ)
    except OSError as exc:
        reason = f"cannot read input ({type(exc).__name__})"
        return run_plain(nvcc, inv.args), Outcome("uncacheable", reason=reason)
    except ValueError as exc:
        return _without_cache(nvcc, inv.args, exc), None
    from kernelcache.errors import KernelCacheError

    try:
        cache = _open_cache(settings)
    except (KernelCacheError, OSError) as exc:
        return _without_cache(nvcc, inv.args, exc), None
    with cache:
        hit = lookup(cache.get, job)
        if hit is not None and write_outputs(inv, hit[1], job.basedir):
            replay(*messages(hit[1], job.basedir))
            return 0, Outcome("hits", saved=saved_seconds(hit[1]))
        from kernelcache.nvcc import miss

        return miss.handle(cache, job, on_start=wake)


def _open_cache(settings: Settings) -> Cache:
    from kernelcache import _trust
    from kernelcache.cache import Cache
    from kernelcache.errors import StoreError

    try:  # a refusal is said once, by the caller: no tier is opened to say it again
        fd = _trust.open_dir(settings.dir)
    except _trust.UntrustedDirectory as exc:
        raise StoreError(f"refusing {exc}") from None
    except OSError:
        fd = None  # unusable for another reason: the tiers say which
    if fd is not None:
        os.close(fd)
    cache = Cache(settings=settings)
    refused = next((tier.unusable for tier in cache.tiers if tier.unusable), None)
    if refused is not None:  # the directory is someone else's, or not one: say so
        cache.close()
        raise StoreError(refused)
    return cache


def _without_cache(nvcc: str, args: list[str], exc: BaseException) -> int:
    # A launcher must never be why a build fails: a bad KERNELCACHE_*
    # value or an unusable cache directory costs the cache, not the compile.
    print(f"kernelcache: cache unavailable, compiling without it: {exc}", file=sys.stderr)
    return run_plain(nvcc, args)


def run_plain(nvcc: str, args: list[str]) -> int:
    import subprocess

    try:
        return subprocess.run([nvcc, *args], check=False).returncode
    except OSError as exc:
        print(f"kernelcache: cannot run {nvcc}: {exc}", file=sys.stderr)
        return 127


def forget(argv: list[str], cache: Cache | None = None) -> int:
    """Drop every cached result of this command line, so its next run is cold.

    Returns how many entries (results and the manifest) were removed; ``0``
    for an uncacheable command or an unreadable source.
    """
    from kernelcache.nvcc import deps as nvcc_deps

    inv = parse(list(argv[1:]))
    if inv.reason is not None:
        return 0
    try:
        job = Job.prepare(resolve_compiler(argv[0], os.environ), inv, os.environ)
    except (OSError, ValueError):
        return 0
    if cache is None:
        from kernelcache.cache import Cache

        cache = Cache()
    results = [str(v.get("result")) for v in nvcc_deps.variants(cache.get(job.direct))]
    return sum(cache.delete(key) for key in [*results, job.direct])


if __name__ == "__main__":  # the client's way in when the server cannot answer
    sys.exit(main(sys.argv[1:]))
