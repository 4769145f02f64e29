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

The *direct key* (:func:`direct_key`) holds the same fields but the headers,
and runs no compiler: the compiler by content alone, the CPU by what
``-march=native`` is derived from (:func:`cpu_identity`), and the environment
variables g++ reads. A manifest under it (:mod:`kernelcache.inductor.cpp_manifest`)
maps the headers a build read to the key above.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelcache import _fs, toolchain
from kernelcache.directives import scan as scan_directives
from kernelcache.inductor.headers import HeaderScans, Load, Save, Scan, Uncacheable
from kernelcache.keys import KeyBuilder
from kernelcache.nvcc.args import host_search
from kernelcache.nvcc.includes import SearchPath

__all__ = [
    "Build",
    "HeaderScans",
    "Uncacheable",
    "build_key",
    "cpu_identity",
    "direct_key",
    "directives",
    "driver",
    "keyed",
    "native_flags",
    "quoted_folder",
    "read_inputs",
]

NAMESPACE = "kernelcache.inductor.cpp"
DIRECT_NAMESPACE = "kernelcache.inductor.cpp.direct"
SCHEMA = 1
#: Environment variables that change what g++ finds or produces, for the same command
#: (the direct key holds them; the header scan sees the search folders they add).
ENV_VARS = (
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH",
    "SOURCE_DATE_EPOCH", "LIBRARY_PATH", "LD_RUN_PATH",
)  # fmt: skip

# A directive: '#' or the '%:' digraph first on a line, after blanks and block comments.
_DIRECTIVE = re.compile(r"^\s*(?:/\*.*?\*/\s*)*(?:#|%:)")
# An OpenMP pragma: g++ 12 fails on one under -fopenmp -E -fdirectives-only ("internal
# compiler error: unspellable token PRAGMA_EOL"), which left every kernel with a
# parallel loop uncached (issue 40). It includes nothing and defines nothing.
_OMP_PRAGMA = re.compile(r"^\s*(?:/\*.*?\*/\s*)*(?:#|%:)\s*pragma\s+omp\b")


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

    @property
    def links(self) -> bool:
        """Whether the build only links objects (no source, so no header, is read)."""
        return self.kind == "so" and all(path.endswith(".o") for path in self.sources)

    def normalized(self) -> list[str]:
        """The command with machine-local paths (sources, output, -include) as placeholders."""
        names = {self.target: "<target>"}
        names.update(dict.fromkeys(self.sources, "<source>"))
        if self.include is not None:
            names[self.include] = "<include>"
        return [names.get(token, token) for token in self.command]

    @property
    def inputs(self) -> list[str]:
        """The files a key holds by content: the sources, then the ``-include`` header."""
        return [*self.sources, *([self.include] if self.include is not None else [])]

    def folders(self) -> str:
        """The folders of :attr:`inputs`, one a line (what a variant holds when the
        sources' own folders decide a lookup: :func:`quoted_folder`)."""
        return "\n".join(os.path.dirname(os.path.abspath(p)) for p in self.inputs)


#: The content of a build's :attr:`Build.inputs`, read once (:func:`read_inputs`).
Inputs = list[bytes]


def directives(text: str) -> str:
    """The preprocessor directives of C++ ``text`` (with their continuation lines).

    What a compile of ``text`` includes depends on these lines only; a line that
    merely looks like one (inside a comment) adds a header to the key, never
    removes one. OpenMP pragmas are left out (they include and define nothing,
    and g++ 12 cannot preprocess them so: :data:`_OMP_PRAGMA`).
    """
    out: list[str] = []
    continued = skipped = False
    for line in text.splitlines():
        if continued:
            if not skipped:
                out.append(line)
        elif _DIRECTIVE.match(line):
            skipped = _OMP_PRAGMA.match(line) is not None
            if not skipped:
                out.append(line)
        else:
            continue
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


def read_inputs(build: Build) -> Inputs:
    """The content of ``build``'s sources and ``-include`` header (:attr:`Build.inputs`)."""
    return [_read(path) for path in build.inputs]


def _split(build: Build, inputs: Inputs) -> tuple[list[bytes], bytes]:
    return inputs[: len(build.sources)], inputs[-1] if build.include is not None else b""


def quoted_folder(build: Build, inputs: Inputs) -> str | None:
    """The folder the build's quoted includes of a relative name start in, if any.

    g++ looks up ``#include "h.h"`` of a source first in the source's folder:
    the same source in another folder may read another header (``b/h.h``
    shadowing ``-Iinc/h.h``). A build whose inputs have such an include is so
    keyed and recorded for its folder; torch's kernels have none (``<...>``
    and absolute names only), so their keys and variants hold no folder.
    Raises :class:`Uncacheable` where the scan cannot stand where the compile
    stands (inputs in two folders, a relative search folder).
    """
    folders = set()
    for path, data in zip(build.inputs, inputs, strict=True):
        found = scan_directives(data)
        # A directive the scanner does not follow (a computed #include) may be quoted.
        if found.unsure is not None or any(
            quoted and not os.path.isabs(name) for quoted, _next, name in found.includes
        ):
            folders.add(os.path.dirname(os.path.abspath(path)))
    if not folders:
        return None
    if len(folders) > 1:
        raise Uncacheable(f"quoted includes beside inputs in {len(folders)} folders")
    for _kind, value in host_search(build.preprocess_flags).includes:
        if not os.path.isabs(value):
            raise Uncacheable(f"a relative search option ({value!r}) beside quoted includes")
    return folders.pop()


def build_key(
    build: Build, scans: HeaderScans, torch_version: str, memo: tuple[Load, Save] | None = None
) -> str:
    """The kernelcache key of ``build`` (see the module docstring for its fields)."""
    return keyed(build, scans, torch_version, memo)[0]


def keyed(
    build: Build,
    scans: HeaderScans,
    torch_version: str,
    memo: tuple[Load, Save] | None = None,
    inputs: Inputs | None = None,
    search: SearchPath | None = None,
) -> tuple[str, Scan | None]:
    """:func:`build_key`, and the header scan it holds (``None`` for a link: no headers).

    ``inputs``: :func:`read_inputs`' answer where the caller has it (read once);
    ``search``: where the build looks headers up, for the scan's memo
    (:meth:`HeaderScans.digest`: without it, nothing is remembered).
    """
    compiler = resolve(build.compiler)
    identity = toolchain.executable(driver(compiler))
    if identity.startswith("probe_failed:"):
        raise Uncacheable(f"cannot identify the compiler {compiler}: {identity}")
    inputs = read_inputs(build) if inputs is None else inputs
    sources, include = _split(build, inputs)
    key = KeyBuilder(NAMESPACE).add("schema", SCHEMA).add("torch", torch_version)
    key.add("kind", build.kind).add("compiler", identity)
    key.add("native", native_flags(compiler) if _native(build) else "")
    key.add("command", tuple(build.normalized()))
    key.add("files", _response_files(build))
    key.add("sources", tuple(hashlib.sha256(s).hexdigest() for s in sources))
    key.add("include", include)
    scan = None
    if not build.links:
        folder = quoted_folder(build, inputs)
        text = directives(include.decode("utf-8", "replace"))
        text += "".join(directives(s.decode("utf-8", "replace")) for s in sources)
        flags = build.preprocess_flags
        scan = scans.digest(compiler, identity, flags, text, memo, folder, search)
    return key.add("headers", scan.digest if scan is not None else "").hexdigest(), scan


def _response_files(build: Build) -> tuple[tuple[str | None, ...], ...]:
    """The content digests of the command's ``@file`` options (g++ reads options there)."""
    return tuple(tuple(row) for row in host_search(build.command).keyed)


#: The options that make g++ derive code from this machine's CPU (``-mcpu=native``:
#: torch's default on ppc64le and aarch64).
_NATIVE = frozenset({"-march=native", "-mtune=native", "-mcpu=native"})


def _native(build: Build) -> bool:
    return any(t in _NATIVE for t in build.command)


def direct_key(
    build: Build, torch_version: str, env: Mapping[str, str], inputs: Inputs | None = None
) -> str:
    """The key of ``build``'s manifest: every field of :func:`build_key` but the headers.

    Computed without running anything: the compiler by the content of its
    files (:func:`compiler_files`), ``-march=native`` by the CPU it is derived
    from (:func:`cpu_identity`; g++'s expansion where that cannot be read), and
    the environment variables g++ reads (:data:`ENV_VARS`). ``inputs``:
    :func:`read_inputs`' answer where the caller has it.
    """
    compiler = resolve(build.compiler)
    native = ""
    if _native(build):
        native = cpu_identity() or native_flags(compiler)
    key = KeyBuilder(DIRECT_NAMESPACE).add("schema", SCHEMA).add("torch", torch_version)
    key.add("kind", build.kind).add("compiler", compiler_files(compiler)).add("native", native)
    key.add("command", tuple(build.normalized())).add("files", _response_files(build))
    sources, include = _split(build, read_inputs(build) if inputs is None else inputs)
    key.add("sources", tuple(hashlib.sha256(s).hexdigest() for s in sources))
    key.add("include", include)
    return key.add("env", {name: env.get(name) for name in ENV_VARS}).hexdigest()


def compiler_files(compiler: str) -> str:
    """The compiler by content: its file's and those a wrapper script names (no run).

    ``--version`` (in :func:`build_key`'s identity) is printed by the same bytes.
    Behind a launcher (:func:`driver`), the launcher's and the real compiler's
    files. A file of another name with no compiler behind it (``icpx``, or a
    launcher this cannot follow) is identified as the entry's key identifies it:
    :func:`kernelcache.toolchain.executable` (``--version`` and content, memoised by stat).
    """
    try:
        behind = driver(compiler)
        if behind == compiler and not _is_driver(compiler):
            identity = toolchain.executable(compiler)
            if identity.startswith("probe_failed:"):
                raise Uncacheable(f"cannot identify the compiler {compiler}: {identity}")
            return identity
        files = []
        for path in dict.fromkeys([compiler, behind]):
            real = _fs.realpath(path)
            files += [real, *toolchain.script_targets(real)]
        return "\n".join(f"{os.path.basename(p)}:{toolchain.file_digest(p)}" for p in files)
    except OSError as exc:
        raise Uncacheable(f"cannot read the compiler {compiler}: {exc}") from exc


#: A compiler driver's file name: ``g++``, ``x86_64-linux-gnu-g++-12``, ``clang++-18``, ``cc``.
_DRIVER = re.compile(r"^(?:[\w.]+-)*(?:gcc|g\+\+|c\+\+|cc|clang|clang\+\+)(?:-[\d.]+)?$")


def _is_driver(path: str) -> bool:
    return _DRIVER.match(os.path.basename(_fs.realpath(path))) is not None


def driver(compiler: str) -> str:
    """The compiler that ``compiler`` (a path, as :func:`resolve` finds it) runs.

    A name that resolves to no compiler driver (``/usr/lib/ccache/g++`` is a
    link to ``ccache``; sccache, distcc) may be a launcher: it runs the next
    compiler of that name on ``PATH``, which its own bytes (and its
    ``--version``, ccache's) say nothing of. That one is then the compiler the
    keys identify; without one, ``compiler`` itself.
    """
    if _is_driver(compiler):
        return compiler
    name = os.path.basename(compiler)
    here = os.path.dirname(os.path.abspath(compiler))
    folders = [os.path.abspath(f or ".") for f in os.environ.get("PATH", "").split(os.pathsep)]
    for folder in folders[folders.index(here) + 1 :] if here in folders else folders:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK) and _is_driver(path):
            return path
    return compiler


#: /proc/cpuinfo fields that differ between the cores of one CPU, or over time,
#: without changing what ``-march=native`` means.
_PER_CORE = frozenset({
    "processor", "physical id", "siblings", "core id", "cpu cores", "apicid",
    "initial apicid", "cpu mhz", "bogomips", "microcode", "bugs",
})  # fmt: skip
_CACHE_FIELDS = ("level", "type", "size", "coherency_line_size", "ways_of_associativity")


@functools.cache
def cpu_identity() -> str | None:
    """What ``-march=native`` is derived from, read without running g++; ``None`` if unknown.

    GCC's driver derives it from ``cpuid``: vendor, family, model, the feature
    bits and the cache sizes. Linux shows the same in ``/proc/cpuinfo`` (each
    distinct core description: big and little cores differ) and in the cache
    folders of ``/sys/devices/system/cpu/cpu0``. Where there is no ``flags``
    line (not an x86 Linux), ``None``: the caller asks g++ itself.
    """
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    cores: set[str] = set()
    for block in text.split("\n\n"):
        fields = []
        for line in block.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip().lower() not in _PER_CORE:
                fields.append(f"{name.strip().lower()}:{value.strip()}")
        if fields:
            cores.add("\n".join(fields))
    if not any("\nflags:" in f"\n{core}" for core in cores):
        return None
    caches = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        indexes = sorted(os.listdir(base))
    except OSError:
        indexes = []  # no cache folders shown: the CPU's fields above still count
    for index in indexes:
        for name in _CACHE_FIELDS:
            try:
                with open(os.path.join(base, index, name)) as f:
                    caches.append(f"{index}/{name}:{f.read().strip()}")
            except OSError:
                continue
    return "\n\n".join([*sorted(cores), "\n".join(caches)])
