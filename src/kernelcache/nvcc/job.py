"""One cacheable nvcc call: its parse, environment and keys, the direct lookup, its outcome.

Shared by the launcher run in-process (:mod:`kernelcache.nvcc.launcher`, the
miss path in :mod:`kernelcache.nvcc.miss`) and by the launcher's server
(:mod:`kernelcache.nvcc.server`), which answers for a client in another
directory and environment: everything here takes the environment as an
argument and reads relative paths against the current directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelcache.nvcc import deps as nvcc_deps
from kernelcache.nvcc import includes
from kernelcache.nvcc import key as nvcc_key
from kernelcache.nvcc.args import Invocation, basedir_of, parse
from kernelcache.stats.launcher import count

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from kernelcache.entry import Entry
    from kernelcache.settings import Settings


class Outcome:
    """What one launcher call did, counted once in ``nvcc-stats.json`` (:meth:`record`).

    ``event`` is ``hits``, ``misses``, ``uncacheable`` or ``failed``;
    ``reason`` says why a call was uncacheable; ``detail`` names a sub-counter
    (``preprocessed_hits``); ``saved`` is the compile time a hit saved.
    """

    __slots__ = ("detail", "event", "reason", "saved")

    def __init__(
        self, event: str, reason: str | None = None, saved: float = 0.0, detail: str | None = None
    ) -> None:
        self.event, self.reason, self.saved, self.detail = event, reason, saved, detail

    def record(self, settings: Settings) -> None:
        count(settings, self.event, reason=self.reason, saved=self.saved, detail=self.detail)

    def __repr__(self) -> str:
        return f"Outcome({self.event!r}, reason={self.reason!r})"


class Job:
    """A cacheable call, ready to look up. :meth:`prepare` reads the source and the toolchain."""

    __slots__ = (
        "args",
        "basedir",
        "command",
        "direct",
        "env",
        "folder",
        "inv",
        "nvcc",
        "sloppy",
    )

    def __init__(
        self,
        nvcc: str,
        inv: Invocation,
        env: Mapping[str, str],
        command: str,
        direct: str,
        folder: str | None = None,
    ) -> None:
        self.nvcc, self.inv, self.args, self.env = nvcc, inv, inv.args, env
        self.command, self.direct = command, direct
        self.basedir = basedir_of(dict(env))
        self.sloppy = nvcc_key.sloppiness(env)
        #: The source's folder when the keys leave it out (:func:`nvcc_key.portable_folder`).
        self.folder = folder

    @classmethod
    def prepare(
        cls,
        nvcc: str,
        inv: Invocation,
        env: Mapping[str, str],
        known: nvcc_key.Identities | None = None,
    ) -> Job:
        """Raises ``OSError`` when the source cannot be read, ``ValueError`` on a bad setting."""
        from kernelcache.nvcc import flight

        flight.timeout(env)  # a bad setting is said before any work (ValueError)
        with open(inv.source or "", "rb") as f:
            source = f.read()
        folder = nvcc_key.portable_folder(inv, env)
        if folder is not None:  # keyed relative to the folder, as KERNELCACHE_BASEDIR keys
            env = {**env, "KERNELCACHE_BASEDIR": folder}
            inv = parse(inv.args, env)
        command = nvcc_key.command_key(nvcc, inv, env, known)
        return cls(nvcc, inv, env, command, nvcc_key.direct_key(command, source), folder)

    def search_path(self) -> includes.SearchPath:
        return includes.search_path(self.inv, self.env)


def lookup(get: Callable[[str], Entry | None], job: Job) -> tuple[Entry, Entry] | None:
    """``(manifest, result)`` of the variant whose dependencies are unchanged, or ``None``."""
    manifest = get(job.direct)
    for variant in nvcc_deps.variants(manifest):
        if variant.get("folder", job.folder) != job.folder:
            continue  # a result that names another folder (nvcc_key.names_folder)
        if nvcc_deps.matches(variant.get("deps", []), job.basedir) and includes.still_absent(
            variant.get("absent", []), job.basedir
        ):
            result = get(str(variant.get("result")))
            if result is not None and manifest is not None:
                return manifest, result
    return None


def saved_seconds(result: Entry) -> float:
    value = result.meta.get("compile_seconds", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0
