"""ninetoothed's generated-source files, written atomically and named by source and kernel name.

ninetoothed 0.26.0 (``generation.cache_source``) writes each generated Triton
module to ``~/.ninetoothed/<sha256(source)>.py`` with ``open(path, "w")``
when the file does not exist yet. A second process that finds the file while
the first is still writing imports a truncated module and fails with
``AttributeError: module ... has no attribute ...`` (33 of 400 concurrent
generate+import pairs on this machine). ninetoothed #161 adds the kernel
name to the digest; its own fix still failed 13 of 400, because the write
stays non-atomic. Here the file is written to a unique temporary name and
renamed into place, so a reader finds either no file or the whole one.
"""

from __future__ import annotations

import pathlib
import re

from kernelcache import _fs
from kernelcache.keys import KeyBuilder

NAMESPACE = "kernelcache.ninetoothed.source"
_DEF = re.compile(r"^def (\w+)\(", re.MULTILINE)


def kernel_names(source: str) -> list[str]:
    """The top-level functions a generated module defines (its kernel and launcher)."""
    return _DEF.findall(source)


def digest(source: str, kernel_name: str | None = None) -> str:
    """The file name stem of ``source`` generated for ``kernel_name``.

    Upstream callers pass only the source; the names it defines stand in for
    the kernel name then (the generator writes the kernel name into the source).
    """
    names = [kernel_name] if kernel_name is not None else kernel_names(source)
    return KeyBuilder(NAMESPACE).add("source", source).add("kernel_names", names).hexdigest()


def write_once(folder: pathlib.Path, source: str, kernel_name: str | None = None) -> pathlib.Path:
    """``folder/<digest>.py`` holding ``source``, written atomically if it is not there yet."""
    path = folder / f"{digest(source, kernel_name)}.py"
    data = source.encode("utf-8")
    try:
        if path.stat().st_size == len(data):
            return path  # renamed into place whole: the size is the only check needed
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    # Atomic: a concurrent writer's rename holds the same bytes.
    _fs.write_atomic(str(path), data, mode=0o644)
    return path
