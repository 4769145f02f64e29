"""Which releases of a tool an integration accepts: a tested range, then the seams it probes.

Each integration names the oldest and newest release it was tested on
(:class:`Range`) and the upstream names it needs (its *seams*:
``"module:attr.attr"`` strings, or a tuple of alternatives where a name moved
between releases). :func:`decide` turns a version into a :class:`Support`:

- inside the range: ``tested``, provided every seam is there;
- outside it, every seam there: ``untested``, installed with one warning, so
  that tomorrow's release does not silently lose the cache;
- a seam missing: ``refused``, with one line naming the seam and the newest
  tested release;
- outside the range with ``KERNELCACHE_STRICT_VERSIONS=1``: ``refused``.

Versions are compared by their release numbers (``2.13.0+cpu`` and
``2.15.0rc1`` are 2.13.0 and 2.15.0), never as strings. A range's bound
covers every release that starts with it: ``newest="2.15"`` admits 2.15.3.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Iterable, Sequence

from kernelcache.settings import flag

__all__ = ["Range", "Seam", "Support", "decide", "missing_seams", "release"]

#: ``"module:attr.attr"``, or alternatives of which one must be there (a name that moved).
Seam = str | tuple[str, ...]
STRICT = "strict_versions"  # the Settings field behind KERNELCACHE_STRICT_VERSIONS

_RELEASE = re.compile(r"\d+(?:\.\d+)*")


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the start of ``version`` (``"2.13.0+cpu"`` -> ``(2, 13, 0)``)."""
    match = _RELEASE.match(version.strip().lstrip("vV"))
    if match is None:
        raise ValueError(f"not a release number: {version!r}")
    return tuple(int(part) for part in match.group().split("."))


@dataclasses.dataclass(frozen=True)
class Range:
    """The releases an integration was tested on, both ends included."""

    oldest: str
    newest: str

    def __post_init__(self) -> None:
        if release(self.oldest) > release(self.newest):
            raise ValueError(f"empty range: {self.oldest} is newer than {self.newest}")

    def __contains__(self, version: object) -> bool:
        if not isinstance(version, str):
            return False
        low, high = release(self.oldest), release(self.newest)
        got = release(version)
        got += (0,) * (len(low) - len(got))  # "3" is 3.0.0, inside a range from 3.0
        return low <= got[: len(low)] and got[: len(high)] <= high

    def __str__(self) -> str:
        return f"{self.oldest} to {self.newest}"


@dataclasses.dataclass(frozen=True)
class Support:
    """What an integration does with one release of its tool."""

    version: str
    status: str  # "tested", "untested" (installs, warns once) or "refused"
    reason: str  # one line, for the warning, ``kernelcache doctor`` and the docs

    @property
    def installs(self) -> bool:
        return self.status != "refused"


def _present(seam: str) -> bool:
    module_name, _, attributes = seam.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError:
        return False
    for name in filter(None, attributes.split(".")):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def missing_seams(seams: Iterable[Seam]) -> list[str]:
    """The seams not found in the installed tool (a tuple counts as found if any of it is)."""
    missing = []
    for seam in seams:
        choices = (seam,) if isinstance(seam, str) else seam
        if not any(_present(choice) for choice in choices):
            missing.append(" or ".join(choices))
    return missing


def decide(tool: str, version: str, tested: Range, seams: Sequence[Seam]) -> Support:
    """How an integration over ``tool`` treats ``version`` (see the module's docstring)."""
    try:
        in_range = version in tested
    except ValueError:
        return Support(version, "refused", f"{tool} {version!r} has no release number")
    missing = missing_seams(seams)
    if missing:
        return Support(
            version,
            "refused",
            f"{tool} {version} lacks {missing[0]} (tested: {tool} {tested}; "
            f"newest tested {tested.newest})",
        )
    if in_range:
        return Support(version, "tested", f"{tool} {version} is tested ({tested})")
    if flag(STRICT, os.environ):
        return Support(
            version,
            "refused",
            f"{tool} {version} is outside the tested {tested} and "
            "KERNELCACHE_STRICT_VERSIONS is on",
        )
    return Support(
        version,
        "untested",
        f"{tool} {version} is untested (tested: {tested}); every seam kernelcache needs is there",
    )
