"""Keys of Inductor's C++ builds: source, compiler identity, flags and every header read.

A key names one ``CppBuilder.build()`` of torch 2.13 (a kernel ``.so``, an
object file, a precompiled header, an ISA probe): what it reads and what
decides its bytes, never where it ran:

- the command line as tokens, with the sources, the output and the
  ``-include`` header replaced by placeholders (their contents are fields of
  their own; torch's cache directories differ per machine and user);
- the content of each source and of the ``-include`` header;
- the compiler: :func:`kernelcache.toolchain.executable` (``--version`` and a
  content hash of the binary, memoised by stat);
- what ``-march=native`` means here (:func:`native_flags`): torch builds with
  it, so the same command gives other code on another CPU;
- the headers: the source's preprocessor directives, preprocessed with the
  same flags (``-E -fdirectives-only``, ~0.1 s for ``cpp_prefix.h``): every
  header the compile can reach, by any spelling, is in that text
  (:mod:`kernelcache.inductor.headers`; all kernels of a model share one).

What cannot be keyed this way (the preprocessor fails, a source is not
readable) raises :class:`Uncacheable`, and the build runs uncached.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from kernelcache import toolchain
from kernelcache.inductor.headers import HeaderScans, Load, Save, Uncacheable
from kernelcache.keys import KeyBuilder

__all__ = ["Build", "HeaderScans", "Uncacheable", "build_key", "directives", "native_flags"]

NAMESPACE = "kernelcache.inductor.cpp"
SCHEMA = 1

# A directive: '#' or the '%:' digraph first on a line, after blanks and block comments.
_DIRECTIVE = re.compile(r"^\s*(?:/\*.*?\*/\s*)*(?:#|%:)")


# torch 2.13's private CppBuilder fields a key reads (the command line in pieces).
SOURCES, INCLUDES, DEFINES = "_sources_args", "_include_dirs_args", "_definitions_args"
CFLAGS, PASSTHROUGH = "_cflags_args", "_passthrough_parameters_args"
PRECOMPILING, COMPILE_ONLY = "_precompiling", "_compile_only"
#: Everything of a ``CppBuilder`` the hooks read (cpp.py's own fields included).
FIELDS = (
    SOURCES, INCLUDES, DEFINES, CFLAGS, PASSTHROUGH, PRECOMPILING, COMPILE_ONLY,
    "_preprocessing", "_use_relative_path", "get_command_line", "get_target_file_path",
)  # fmt: skip


def missing_fields(builder_class: type) -> list[str]:
    """The :data:`FIELDS` that ``builder_class`` neither has nor sets in its code.

    They are instance attributes, so :func:`kernelcache.versions.missing_seams`
    cannot see them: a field counts as there when a method of the class (or a
    base) names it, which is how ``self._sources_args = ...`` in ``__init__`` shows.
    A torch that renamed one gets no C++ hooks, rather than a hook that fails.
    """
    names: set[str] = set()
    for klass in builder_class.__mro__:
        for member in vars(klass).values():
            code = getattr(member, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return [f for f in FIELDS if f not in names and not hasattr(builder_class, f)]


def _args(builder: Any, field: str) -> list[str]:
    return shlex.split(getattr(builder, field))


@dataclass(frozen=True)
class Build:
    """What a key needs from one ``CppBuilder`` (torch 2.13's private fields, read once)."""

    kind: str  # "so", "o", "gch": what the output is
    command: list[str]  # the full command line, as tokens
    sources: list[str]
    target: str
    include: str | None  # the file given with -include (a precompiled header's source)
    # The flags that reach the preprocessor: definitions, cflags, -I dirs, passthrough.
    preprocess_flags: list[str]

    @classmethod
    def of(cls, builder: Any) -> Build:
        sources = [t for t in _args(builder, SOURCES) if t not in ("-x", "c++-header")]
        include_args = _args(builder, INCLUDES)
        include = None
        if "-include" in include_args:
            at = include_args.index("-include")
            include = include_args[at + 1]
            del include_args[at : at + 2]
        if getattr(builder, PRECOMPILING):
            kind = "gch"
        elif getattr(builder, COMPILE_ONLY):
            kind = "o"
        else:
            kind = "so"
        flags = [
            *_args(builder, DEFINES),
            *_args(builder, CFLAGS),
            *include_args,
            *_args(builder, PASSTHROUGH),
        ]
        return cls(
            kind=kind,
            command=shlex.split(builder.get_command_line()),
            sources=sources,
            target=builder.get_target_file_path(),
            include=include,
            preprocess_flags=flags,
        )

    @property
    def compiler(self) -> str:
        return self.command[0]

    def normalized(self) -> list[str]:
        """The command with machine-local paths (sources, output, -include) as placeholders."""
        names = {self.target: "<target>"}
        names.update(dict.fromkeys(self.sources, "<source>"))
        if self.include is not None:
            names[self.include] = "<include>"
        return [names.get(token, token) for token in self.command]


def directives(text: str) -> str:
    """The preprocessor directives of C++ ``text`` (with their continuation lines).

    What a compile of ``text`` includes depends on these lines only; a line that
    merely looks like one (inside a comment) adds a header to the key, never
    removes one.
    """
    out: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued or _DIRECTIVE.match(line):
            out.append(line)
            continued = line.endswith("\\")
    return "\n".join(out) + "\n"


@functools.cache
def resolve(compiler: str) -> str:
    """The compiler's path as the shell would find it (torch runs it by name)."""
    found = compiler if os.sep in compiler else shutil.which(compiler)
    if found is None:
        raise Uncacheable(f"compiler {compiler!r} not found on PATH")
    return found


@functools.cache
def native_flags(compiler: str) -> str:
    """What ``-march=native`` / ``-mtune=native`` expand to on this machine.

    GCC prints its cc1 command line under ``-v``: the ISA switches, ``-mtune``
    and the cache-size params it derived from ``cpuid``. One run of ~15 ms per
    process. Another compiler's whole ``-v`` output is taken (conservative).
    """
    cmd = [compiler, "-march=native", "-E", "-v", "-x", "c++", os.devnull, "-o", os.devnull]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return toolchain.failed(exc)
    text = proc.stderr.decode("utf-8", "replace")
    for line in text.splitlines():
        if "cc1" in line and "-march=" in line:
            tokens = shlex.split(line)
            kept = [
                t
                for i, t in enumerate(tokens)
                if t.startswith(("-m", "--param")) or (i and tokens[i - 1] == "--param")
            ]
            return " ".join(kept)
    return f"rc={proc.returncode}\n{text}"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise Uncacheable(f"cannot read {path}: {exc}") from exc


def build_key(
    build: Build, scans: HeaderScans, torch_version: str, memo: tuple[Load, Save] | None = None
) -> str:
    """The kernelcache key of ``build`` (see the module docstring for its fields)."""
    compiler = resolve(build.compiler)
    identity = toolchain.executable(compiler)
    if identity.startswith("probe_failed:"):
        raise Uncacheable(f"cannot identify the compiler {compiler}: {identity}")
    sources = [_read(path) for path in build.sources]
    include = _read(build.include) if build.include is not None else b""
    native = any(t in ("-march=native", "-mtune=native") for t in build.command)
    key = KeyBuilder(NAMESPACE).add("schema", SCHEMA).add("torch", torch_version)
    key.add("kind", build.kind).add("compiler", identity)
    key.add("native", native_flags(compiler) if native else "")
    key.add("command", tuple(build.normalized()))
    key.add("sources", tuple(hashlib.sha256(s).hexdigest() for s in sources))
    key.add("include", include)
    if build.kind == "so" and all(path.endswith(".o") for path in build.sources):
        headers = ""  # a link: objects in, no headers read
    else:
        text = directives(include.decode("utf-8", "replace"))
        text += "".join(directives(s.decode("utf-8", "replace")) for s in sources)
        headers = scans.digest(compiler, identity, build.preprocess_flags, text, memo)
    return key.add("headers", headers).hexdigest()
