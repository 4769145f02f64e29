"""Keys of JAX's executables in kernelcache: JAX's own key, plus what JAX leaves out of it.

JAX's cache key hashes the module, the devices, the compile options, the
backend and the name of the compressor it *imported*. It leaves out what
makes the bytes readable elsewhere: the jax and jaxlib releases (an
executable is deserialized by the jaxlib that reads it), the Python release,
the machine, and the compression the bytes were really written with
(JAX 0.10 on Python 3.14 compresses with the standard library's zstd while
its key still says ``zlib`` when ``zstandard`` is absent). :class:`Setup`
holds those, probed once; :func:`entry_key` mixes them in, so two setups
never share an entry.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import zlib
from collections.abc import Callable
from typing import Any

from kernelcache.explain import note_fields
from kernelcache.keys import KeyBuilder

__all__ = ["NAMESPACE", "ZSTD_MAGIC", "Setup", "compression", "entry_key", "note", "xla_flags"]

#: Key namespace; bump the version when the entry layout changes.
NAMESPACE = "jax/1"
#: The first bytes of every zstd frame (RFC 8878, section 3.1.1).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PROBE = b"kernelcache: which compression does JAX use?"


def compression(compress: Callable[[bytes], bytes]) -> tuple[str, bytes]:
    """The format ``compress`` writes (``"zstd"``, ``"zlib"``) and the prefix its output
    always starts with, found by compressing a probe: what JAX really does, whatever
    its key says."""
    probe = compress(_PROBE)
    if probe.startswith(ZSTD_MAGIC):
        return "zstd", ZSTD_MAGIC
    try:
        if zlib.decompress(probe) == _PROBE:
            return "zlib", probe[:1]  # CMF: deflate with the window size JAX's level uses
    except zlib.error:
        pass  # neither: keyed by its first bytes, and no prefix check
    return f"unknown-{probe[:4].hex()}", b""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What JAX's key leaves out, probed once per process."""

    jax: str
    jaxlib: str
    python: str
    machine: str
    compression: str
    prefix: bytes  # every value JAX puts starts with it (b"": not checked)

    @classmethod
    def probe(cls) -> Setup:
        from importlib.metadata import version

        import jax
        from jax._src import compilation_cache

        name, prefix = compression(compilation_cache.compress_executable)
        return cls(
            jax=str(jax.__version__),
            jaxlib=version("jaxlib"),
            python=f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}",
            machine=platform.machine(),
            compression=name,
            prefix=prefix,
        )

    def fields(self) -> dict[str, Any]:
        """The fields in every key, kept in each entry's meta (``kernelcache show``)."""
        return {
            "jax": self.jax,
            "jaxlib": self.jaxlib,
            "python": self.python,
            "machine": self.machine,
            "compression": self.compression,
        }

    def readable(self, value: bytes) -> bool:
        """Whether ``value`` starts as JAX's compressed executables do here."""
        return len(value) > len(self.prefix) and value.startswith(self.prefix)


def entry_key(setup: Setup, jax_key: str) -> str:
    """The kernelcache key of one of JAX's cache keys (``jit_f-<sha256>``) in ``setup``."""
    builder = KeyBuilder(NAMESPACE).add("jax_key", jax_key)
    for label, value in setup.fields().items():
        builder.add(label, value)
    return builder.hexdigest()


def note(key: str, jax_key: str) -> None:
    """Note, with the entry stored under ``key``, the parts of JAX's key kernelcache can
    see: the module's name and the XLA flags JAX keys (issue 38). The rest of JAX's key
    (the program, its compile options, the devices) stays in ``jax_key``, which
    ``kernelcache explain`` names only when nothing noted differs. A put, never a hit."""
    note_fields(key, {"module": jax_key.rpartition("-")[0], "xla_flags": xla_flags()})


def xla_flags() -> list[str]:
    """The XLA flags in JAX's key, as JAX takes them (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``,
    ``--xla*`` arguments; sorted, the ones it leaves out left out)."""
    flags: list[str] = []

    class Taken:  # what JAX hashes, one flag per update
        def update(self, data: bytes) -> None:
            flags.append(data.decode("utf-8", "replace"))

    try:
        from jax._src import cache_key

        cache_key._hash_xla_flags(Taken(), cache_key.get_flag_prefixes())  # noqa: SLF001
    except (ImportError, AttributeError, TypeError):  # another JAX: the variable as set
        return sorted(os.environ.get("XLA_FLAGS", "").split())
    return flags
