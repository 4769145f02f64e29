"""``kernelcache doctor``: is this machine set up right? One check per line, with its fix.

Most "kernelcache does nothing" reports are one of these: a setting with a
typo, a cache directory the trust rule refuses or that sits on a network
filesystem, a team tier that is down or signed with a secret this machine
lacks, a tool release an integration refuses, a launcher whose client was
never built. :func:`run` checks each, through the same code the cache runs
(settings, the trust rule, the tiers, ``Integration`` version rules), and
returns :class:`Check` rows; a ``problem`` makes the command exit non-zero.

The team tier is checked through the store interface (``get``, ``keys``,
``stats``, counters), so every kind of team tier gets the same checks.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kernelcache import _trust, fstype
from kernelcache.errors import ConfigError, KernelCacheError, StoreError
from kernelcache.settings import VARIABLES, Settings
from kernelcache.units import format_size

if TYPE_CHECKING:
    from kernelcache.stores.base import Store

__all__ = ["INTEGRATIONS", "Check", "run"]

#: Free space under which the cache directory is a problem (entries would not fit).
MIN_FREE_BYTES = 1 << 30
#: Team entries read to see whether this machine can verify them.
SAMPLE_ENTRIES = 16


@dataclasses.dataclass
class Check:
    """One line of the report: ``status`` is ``ok``, ``note`` (worth knowing) or ``problem``."""

    area: str
    name: str
    status: str
    detail: str
    fix: str | None = None


@dataclasses.dataclass(frozen=True)
class Tool:
    """An integration as the doctor checks it."""

    name: str
    distribution: str  # the installed package whose version is the tool's
    module: str | None  # the integration module declaring TESTED and SEAMS, if any
    switch: str | None  # the variable that turns it on outside the program, if any
    switch_on: str = "1"


INTEGRATIONS = (
    Tool("nvrtc", "cuda-python", None, None),
    Tool("triton", "triton", None, "TRITON_CACHE_MANAGER", "kernelcache.triton:CacheManager"),
    Tool("tilelang", "tilelang", "kernelcache.tilelang", None),
    Tool("ninetoothed", "ninetoothed", "kernelcache.ninetoothed", None),
    Tool("torch.compile", "torch", "kernelcache.inductor", "KERNELCACHE_INDUCTOR"),
    Tool("jax", "jax", "kernelcache.jax", "KERNELCACHE_JAX"),
)


def run(environ: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in order: settings, cache directory, team tier, launcher, integrations."""
    env = os.environ if environ is None else environ
    checks: list[Check] = []
    settings = _settings(env, checks)
    checks.extend(cache_dir(settings))
    checks.extend(team(settings))
    checks.extend(launcher(settings, env))
    checks.extend(integrations(env))
    return checks


def _settings(env: Mapping[str, str], checks: list[Check]) -> Settings:
    """The settings; a bad variable is a problem, and the rest is checked without it."""
    given = dict(env)
    while True:
        try:
            settings = Settings.load(environ=given)
        except ConfigError as exc:
            bad = next((v for v in VARIABLES if str(exc).startswith(v) and v in given), None)
            checks.append(Check("settings", bad or "settings", "problem", str(exc),
                                f"correct or unset {bad}" if bad else "correct the setting"))  # fmt: skip
            if bad is None:
                return Settings.load(environ={})
            del given[bad]
            continue
        if not any(c.area == "settings" for c in checks):
            checks.append(Check("settings", "settings", "ok", "every KERNELCACHE_* variable reads"))
        return settings


def cache_dir(settings: Settings) -> Iterator[Check]:
    """Trusted, free space, and the filesystem it is on (network rules apply on NFS, Lustre...)."""
    where = settings.dir
    if settings.disable:
        yield Check("cache", "caching", "note", f"{where}: KERNELCACHE_DISABLE is on: no caching",
                    "unset KERNELCACHE_DISABLE")  # fmt: skip
    refusal = _trust.refusal(where)
    if refusal is not None:
        yield Check("cache", "directory", "problem", refusal,
                    f"chmod go-w the directory named (or chown it to you), or choose another "
                    f"KERNELCACHE_DIR; {where} gets no reads or writes until then")  # fmt: skip
    else:
        state = "exists" if os.path.isdir(where) else "will be made, private to you"
        yield Check("cache", "directory", "ok", f"{where}: trusted ({state})")
    found = fstype.detect(where)
    if found.network:
        yield Check("cache", "filesystem", "problem",
                    f"{where} is on {found.name}, a network filesystem: no stat is trusted "
                    "(every hit re-reads), locks work without flock, and other nodes share it",
                    "a local KERNELCACHE_DIR per machine and a team tier (KERNELCACHE_REMOTE) "
                    "for sharing; or keep it shared knowing the slower hits")  # fmt: skip
    else:
        yield Check("cache", "filesystem", "ok", f"{found.name} (local)")
    probe = where
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        yield Check("cache", "free space", "problem", f"cannot tell ({exc.strerror})")
        return
    cap = f", cap {format_size(settings.max_bytes)}" if settings.max_bytes else ", no cap"
    if free < MIN_FREE_BYTES:
        yield Check("cache", "free space", "problem", f"{format_size(free)} free{cap}",
                    "free space, or a smaller KERNELCACHE_MAX_SIZE elsewhere")  # fmt: skip
    else:
        yield Check("cache", "free space", "ok", f"{format_size(free)} free{cap}")


def team(settings: Settings) -> Iterator[Check]:
    """The team tier: reachable and how fast, Cluster or not, the secret and signed entries."""
    if not settings.remote:
        yield Check("team", "team tier", "note", "none (KERNELCACHE_REMOTE is unset)")
        return
    from kernelcache.tiers import default_tiers

    try:
        shared = [t for t in default_tiers(settings.replaced(disable=False)) if t.shared]
    except (KernelCacheError, OSError) as exc:
        yield Check("team", "team tier", "problem", str(exc), "correct KERNELCACHE_REMOTE")
        return
    for tier in shared:
        try:
            yield from _team_tier(tier, settings)
        finally:
            tier.close()


def _counts(tier: Store) -> dict[str, int]:
    try:
        return dict(tier.counters.as_dict())
    except (TypeError, AttributeError):
        return {}


def _team_tier(tier: Store, settings: Settings) -> Iterator[Check]:
    name = repr(tier)
    before = _counts(tier)
    times = []
    try:
        for _ in range(3):
            began = time.perf_counter()
            tier.get("kernelcache-doctor-" + os.urandom(8).hex())
            times.append(time.perf_counter() - began)
    except StoreError as exc:
        yield Check("team", "reachable", "problem", str(exc),
                    "check that the server runs and the URL's host, port and password")  # fmt: skip
        return
    after = _counts(tier)
    failed = {k: after[k] - before.get(k, 0) for k in ("errors", "timeouts") if k in after}
    if any(failed.values()):
        why = ", ".join(f"{v} {k}" for k, v in failed.items() if v)
        yield Check("team", "reachable", "problem", f"{name}: no answer ({why})",
                    "check that the server runs and the URL's host, port and password")  # fmt: skip
        return
    rtt = statistics.median(times) * 1000
    yield Check("team", "reachable", "ok", f"{name}: round trip {rtt:.2f} ms")
    info = tier.stats()
    if "cluster" in info:
        kind = "a Redis Cluster" if info["cluster"] else "a single server (not a Cluster)"
        yield Check("team", "cluster", "ok", kind)
    yield from _signed(tier, settings)


def _signed(tier: Store, settings: Settings) -> Iterator[Check]:
    """Read a few team entries: can this machine verify them with its secret (or lack of one)?"""
    before = _counts(tier)
    read = 0
    try:
        for key in itertools.islice(tier.keys(), SAMPLE_ENTRIES):
            read += tier.get(key) is not None
    except StoreError as exc:
        yield Check("team", "entries", "problem", f"cannot list or read entries: {exc}")
        return
    after = _counts(tier)
    unverifiable = after.get("unverifiable", 0) - before.get("unverifiable", 0)
    forged = after.get("forged", 0) - before.get("forged", 0)
    secret = "set" if settings.secret else "not set"
    if unverifiable:
        yield Check("team", "secret", "problem",
                    f"the team's entries are signed, and KERNELCACHE_SECRET is not set here: "
                    f"{unverifiable} of the entries read could not be verified (each is a miss)",
                    "export KERNELCACHE_SECRET=<the team's secret> (from your secret store)")  # fmt: skip
    elif forged:
        yield Check("team", "secret", "problem",
                    f"{forged} of the entries read fail this machine's KERNELCACHE_SECRET",
                    "use the team's secret (another one signs other entries)")  # fmt: skip
    else:
        what = "signed entries readable" if settings.secret else "entries readable (unsigned)"
        yield Check("team", "secret", "ok", f"KERNELCACHE_SECRET {secret}; {what} ({read} read)")


def launcher(settings: Settings, env: Mapping[str, str]) -> Iterator[Check]:
    """nvcc on PATH, the compiled client built for this machine, the server running."""
    from kernelcache.nvcc import control, native

    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if nvcc is None:
        yield Check("launcher", "nvcc", "note", "no nvcc on PATH: the launcher has nothing to run")
        return
    yield Check("launcher", "nvcc", "ok", nvcc)
    directory = settings.dir
    yield _client(directory, env, native)
    found = control.running(directory) if os.path.isdir(directory) else None
    if found is None:
        yield Check("launcher", "server", "note",
                    "not running (the next `kernelcache nvcc` starts it)")  # fmt: skip
    else:
        yield Check("launcher", "server", "ok", f"running, pid {found[0]}")


def _client(directory: str, env: Mapping[str, str], native: Any) -> Check:
    if not native.wanted(env):
        return Check("launcher", "client", "note",
                     f"{native.ENV} is off: the Python client serves (slower hits)",
                     f"unset {native.ENV}")  # fmt: skip
    tag, boot = native.platform_tag(), native.boot_id()
    try:
        with open(native.SOURCE, "rb") as f:
            source = f.read()
    except OSError:
        return Check(
            "launcher", "client", "note", "no C source installed: the Python client serves"
        )
    if tag is None or boot is None:
        return Check("launcher", "client", "note", "not on Linux: the Python client serves")
    path = os.path.join(directory, native.binary_name(source, tag))
    if os.path.exists(path + ".failed"):
        return Check("launcher", "client", "problem", f"its build failed: see {path}.failed",
                     f"install a C compiler (cc or gcc), then rm {path}.failed")  # fmt: skip
    if native.marked(directory, os.path.basename(path), boot):
        return Check("launcher", "client", "ok", f"built: {path}")
    return Check(
        "launcher", "client", "note", "not built yet (the server builds it when it starts)"
    )


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def integrations(env: Mapping[str, str]) -> Iterator[Check]:
    """Each installed integration: its tool's release (tested, untested, refused), its switch."""
    from importlib import import_module

    from kernelcache.versions import decide

    for tool in INTEGRATIONS:
        version = _version(tool.distribution)
        if version is None:
            yield Check("integration", tool.name, "note", f"{tool.distribution} is not installed")
            continue
        if tool.switch is None:
            switch = "turned on by install() in the program"
        elif env.get(tool.switch) == tool.switch_on:
            switch = f"on ({tool.switch}={tool.switch_on})"
        else:
            switch = f"off (set {tool.switch}={tool.switch_on} to turn it on)"
        if tool.module is None:
            yield Check("integration", tool.name, "ok", f"{tool.distribution} {version}; {switch}")
            continue
        module = import_module(tool.module)
        support = decide(tool.distribution, version, module.TESTED, module.SEAMS)
        if support.status == "refused":
            yield Check("integration", tool.name, "problem", support.reason,
                        f"install {tool.distribution} {module.TESTED} "
                        "(or unset KERNELCACHE_STRICT_VERSIONS for an untested release)")  # fmt: skip
        else:
            status = "ok" if support.status == "tested" else "note"
            yield Check("integration", tool.name, status, f"{support.reason}; {switch}")


def summary(checks: list[Check]) -> dict[str, Any]:
    """What ``--json`` prints: every check, and whether any is a problem."""
    return {
        "ok": not any(c.status == "problem" for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
    }
