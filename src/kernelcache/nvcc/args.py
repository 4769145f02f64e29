"""Understanding an nvcc command line: is it one cacheable compile, and what is its key?

The launcher caches one source compiled with ``-c``, ``-dc``, ``-dw`` (alone
or together, as CMake writes ``-c -dc``), ``-ptx``, ``-cubin`` or ``-fatbin``,
into ``-o`` or the name nvcc picks (``k.cu`` -> ``k.o``, inside ``-odir``),
with optional ``-MD``/``-MMD`` dependency files (``-MF`` or nvcc's default
name). Every option is looked up in :mod:`kernelcache.nvcc.options`; an
option nvcc does not know is keyed as a host compiler option when
``-forward-unknown-to-host-compiler`` is given (nvcc then hands it to gcc),
and makes the call uncacheable otherwise. Linking, several inputs, ``-E``,
``--dryrun`` and options with side effects are uncacheable too, with a
reason, and nvcc runs unchanged.

Path normalisation: relative paths are kept as written (they are relative to
the working directory already, so a copy of a project gives the same key).
Absolute paths are kept as written by default, because nvcc puts them into
outputs (``__FILE__``, debug info); with ``KERNELCACHE_BASEDIR=<dir>``
absolute paths under that directory are keyed relative to it (see docs/nvcc.md
for exactly when two checkouts then share entries). Without it, a ``-cubin`` or
``-ptx`` compile is keyed relative to its source's folder where that folder
cannot change the output (:func:`kernelcache.nvcc.key.portable_folder`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from kernelcache.nvcc.options import ATTACHABLE, BY_NAME, FLAG, HOST_UNCACHEABLE, OPTIONS, VALUE

BASE_TOKEN = "\0BASE\0"
SOURCE_SUFFIXES = (".cu", ".c", ".cc", ".cpp", ".cxx", ".C")
#: The file nvcc writes for each mode when there is no ``-o``.
_SUFFIX = {"c": ".o", "ptx": ".ptx", "cubin": ".cubin", "fatbin": ".fatbin"}
#: Modes that may be combined (``-c -dc``): all produce one object.
_OBJECT_MODES = {"--compile", "--device-c", "--device-w"}
_MAX_OPTFILE_DEPTH = 8


class Invocation:
    """One parsed nvcc call. ``reason`` is set when it cannot be cached.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect``, a
    few milliseconds on the launcher's start-up.
    """

    __slots__ = (
        "args",
        "ccbin",
        "debug",
        "depfile",
        "depmode",
        "deptarget",
        "forward",
        "includes",
        "keyed",
        "mode",
        "modes",
        "odir",
        "output",
        "output_given",
        "reason",
        "source",
        "target",
        "unknown",
    )

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.mode: str | None = None
        self.modes: list[str] = []
        self.source: str | None = None
        self.output: str | None = None  # -o, or the name nvcc picks
        self.output_given = False
        self.odir: str | None = None
        self.target = ""  # the rule target nvcc writes into a dependency file
        self.depmode: str | None = None  # "-MD" or "-MMD"
        self.depfile: str | None = None  # -MF, or the name nvcc picks
        self.deptarget = False  # -MT given
        self.ccbin: str | None = None
        self.debug = False
        self.forward = False
        self.unknown: list[str] = []
        # ("include" | "isystem" | "quote", dir), ("pre", header) or ("unsure", option), in order
        self.includes: list[tuple[str, str]] = []
        self.keyed: list[list[str | None]] = []
        self.reason: str | None = None

    def refuse(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason


def normalize_path(path: str, basedir: str | None) -> str:
    """``path`` as keyed: relative kept; absolute under ``basedir`` made relative to it."""
    if basedir and os.path.isabs(path):
        real = os.path.normpath(path)
        if real == basedir or real.startswith(basedir + os.sep):
            return BASE_TOKEN + os.path.relpath(real, basedir)
    return path


def split_option(token: str) -> tuple[str, str | None] | None:
    """``(long name, attached value)`` for an option token, or ``None`` if unknown."""
    name, eq, value = token.partition("=")
    if name in BY_NAME:
        return BY_NAME[name], (value if eq else None)
    if token[:2] in ATTACHABLE and len(token) > 2:
        return ATTACHABLE[token[:2]], token[2:]
    return None


def _shell_split(text: str) -> list[str]:
    if not text.strip():
        return []
    import shlex  # deferred: most calls have neither options files nor NVCC_*_FLAGS

    return shlex.split(text)


def _expand(tokens: list[str], depth: int = 0) -> list[str]:
    """Splice ``--options-file`` contents in place (CMake passes include dirs this way)."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        split = split_option(token) if token.startswith("-") else None
        if split is not None and split[0] == "--options-file":
            value = split[1]
            if value is None:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            if depth >= _MAX_OPTFILE_DEPTH:
                raise ValueError("options files nested too deeply")
            for name in value.split(","):
                with open(name, encoding="utf-8") as f:
                    out += _expand(_shell_split(f.read()), depth + 1)
        else:
            out.append(token)
        i += 1
    return out


def basedir_of(env: os._Environ[str] | dict[str, str]) -> str | None:
    value = env.get("KERNELCACHE_BASEDIR")
    return os.path.normpath(os.path.abspath(value)) if value else None


def parse(args: list[str], environ: os._Environ[str] | dict[str, str] | None = None) -> Invocation:
    """Classify an nvcc command line (``args`` without the compiler itself)."""
    env = os.environ if environ is None else environ
    inv = Invocation(args=list(args))
    basedir = basedir_of(env)
    extra = _shell_split(env.get("NVCC_PREPEND_FLAGS", ""))
    extra += _shell_split(env.get("NVCC_APPEND_FLAGS", ""))
    try:
        tokens = _expand(list(args)) + _expand(extra)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        inv.refuse(f"unreadable options file ({type(exc).__name__})")
        return inv
    inputs: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("-") or token == "-":
            inputs.append(token)
            continue
        split = split_option(token)
        if split is None:
            inv.unknown.append(token)
            inv.keyed.append(["<host>", token])  # keyed where it stands: order matters to gcc
            continue
        name, value = split
        _short, kind, role = OPTIONS[name]
        if kind == VALUE and value is None:
            if i >= len(tokens):
                inv.refuse(f"option {token} is missing its value")
                break
            value = tokens[i]
            i += 1
        if kind == FLAG and value is not None:
            inv.refuse(f"option {name} takes no value")
        _apply(inv, name, value, role, basedir)
    _check_unknown(inv)
    _finish(inv, inputs, basedir)
    return inv


def _apply(
    inv: Invocation, name: str, value: str | None, role: str | None, basedir: str | None
) -> None:
    if role is None or role in ("debug", "forward"):
        inv.keyed.append([name, value])
        inv.debug = inv.debug or role == "debug"
        inv.forward = inv.forward or role == "forward"
        if name == "--compiler-options":
            _host_options(inv, (value or "").split(","), 0)
    elif role == "neutral":
        return  # nvcc's own check still runs: a bad value fails the compile, uncached
    elif role.startswith("uncacheable:"):
        inv.refuse(role.split(":", 1)[1])
    elif role.startswith("mode:"):
        inv.modes.append(name)
        inv.mode = role.split(":", 1)[1]
        inv.keyed.append([name, None])
    elif role == "output":
        if inv.output is not None:
            inv.refuse("more than one -o")
        inv.output, inv.output_given = value, True
    elif role == "odir":
        inv.odir = value
    elif role == "depmode":
        inv.depmode = "-MMD" if "nonsystem" in name else "-MD"
        inv.keyed.append([name, None])
    elif role == "depfile":
        inv.depfile = value
    elif role == "deptarget":
        inv.deptarget = True
        inv.keyed.append([name, normalize_path(value or "", basedir)])
    elif role == "ccbin":
        inv.ccbin = value
        inv.keyed.append([name, normalize_path(value or "", basedir)])
    else:  # "path", "include", "isystem": comma-separated lists of paths
        paths = (value or "").split(",")
        if role in ("include", "isystem"):
            inv.includes += [(role, p) for p in paths if p]
        elif name == "--pre-include":
            inv.includes += [("pre", p) for p in paths if p]
        inv.keyed.append([name, ",".join(normalize_path(p, basedir) for p in paths)])


def _check_unknown(inv: Invocation) -> None:
    """Options nvcc does not know: host options when forwarded, else nvcc's error."""
    if not inv.unknown:
        return
    if not inv.forward:
        inv.refuse(f"unknown option {inv.unknown[0]}")
        return
    _host_options(inv, inv.unknown, 0)


#: Host options that add to the preprocessor's search path (failed lookups are watched
#: there), or name a header it looks up along it (``-include``), or search folders the
#: scanner does not model (issue 40).
_HOST_SEARCH = {
    "-I": "include",
    "-iquote": "quote",
    "-isystem": "isystem",
    "-idirafter": "isystem",
    "-include": "pre",
    "-imacros": "pre",
    "-iprefix": "unsure",
    "-iwithprefix": "unsure",
    "-iwithprefixbefore": "unsure",
}


def _host_options(inv: Invocation, tokens: list[str], depth: int) -> None:
    """One rule for host options, forwarded or given through ``-Xcompiler`` (issue 19).

    Refused: what :data:`HOST_UNCACHEABLE` names. A gcc response file
    (``@file``) is read, recursively, and its content keyed, or the call
    refused when it cannot be read. ``-I``-like options join the search
    path that failed lookups are watched on; ``-include`` and ``-imacros``
    files are in the dependency list nvcc writes, so their content is keyed
    there, and their lookup is watched like an ``#include "..."``'s.
    """
    expects: str | None = None
    for token in tokens:
        if expects is not None:
            inv.includes.append((expects, token))
            expects = None
        elif token.startswith("@") and len(token) > 1:
            _response_file(inv, token[1:], depth)
        elif token.startswith(HOST_UNCACHEABLE):
            inv.refuse(f"host option {token} is not cached")
        elif token.startswith("-g") and not token.startswith("-gno") and token != "-g0":
            inv.debug = True  # -g3, -ggdb, -gdwarf-4: host debug info names the directory
        else:
            flag = max((f for f in _HOST_SEARCH if token.startswith(f)), key=len, default=None)
            if flag is not None and token == flag:
                expects = _HOST_SEARCH[flag]
            elif flag is not None:
                inv.includes.append((_HOST_SEARCH[flag], token[len(flag) :]))
    if expects is not None:
        # Its folder is in the next -Xcompiler's list: not followed, so not modelled.
        inv.includes.append(("unsure", tokens[-1]))


class HostSearch(NamedTuple):
    """What :func:`host_search` finds in a host compiler's command line."""

    #: The search options, as :attr:`Invocation.includes` holds them.
    includes: list[tuple[str, str]]
    #: Why the command's lookups cannot be modelled (an unreadable response file, ...).
    reason: str | None
    #: What the command reads beyond its tokens (a response file's content digest).
    keyed: list[list[str | None]]


def host_search(tokens: list[str]) -> HostSearch:
    """The search options of a host compiler's command line, as :attr:`Invocation.includes`
    holds them (g++'s own commands: Inductor's C++ builds, :mod:`kernelcache.inductor.cpp_manifest`),
    with the reason they cannot be followed and the response files' content."""
    inv = Invocation([])
    _host_options(inv, tokens, 0)
    return HostSearch(inv.includes, inv.reason, inv.keyed)


def _response_file(inv: Invocation, name: str, depth: int) -> None:
    """Key a gcc response file's content and apply the host rules to its options."""
    if depth >= _MAX_OPTFILE_DEPTH:
        inv.refuse("host response files nested too deeply")
        return
    try:
        with open(name, "rb") as f:
            content = f.read()
        tokens = _shell_split(content.decode("utf-8", "surrogateescape"))
    except (OSError, ValueError) as exc:
        # gcc passes an unreadable @name on as an argument; too odd to cache.
        inv.refuse(f"unreadable host response file @{name} ({type(exc).__name__})")
        return
    from kernelcache.keys import sha256

    inv.keyed.append(["<host-response-file>", sha256(content).hexdigest()])
    _host_options(inv, tokens, depth + 1)


def _finish(inv: Invocation, inputs: list[str], basedir: str | None) -> None:
    if inv.mode is None:
        inv.refuse("not a -c, -ptx, -cubin or -fatbin compile")
    elif len(set(inv.modes)) > 1 and not set(inv.modes) <= _OBJECT_MODES:
        inv.refuse("more than one compilation mode")
    if len(inputs) != 1:
        inv.refuse(f"{len(inputs)} input files (one is cached)")
    elif not inputs[0].endswith(SOURCE_SUFFIXES) and not any(k[0] == "--x" for k in inv.keyed):
        inv.refuse(f"input {inputs[0]} is not a CUDA/C/C++ source")
    else:
        inv.source = inputs[0]
        inv.keyed.append(["<input>", normalize_path(inputs[0], basedir)])
    if inv.depfile is not None and inv.depmode is None:
        inv.refuse("-MF without -MD/-MMD")
    if inv.reason is None:
        _default_names(inv)


def _default_names(inv: Invocation) -> None:
    """The names nvcc 13 gives the output, the rule target and the dependency file.

    Checked against nvcc 13.0: ``k.cu -ptx -odir d -MD`` writes ``d/k.ptx``
    and ``d/k.d`` whose rule names ``d/k.o`` (the target is always the
    object's name); ``-o d/k.o.obj -MD`` writes ``d/k.o.d``. ``-odir`` is
    joined with a plain ``/`` (``-odir d/`` gives ``d//k.o``).
    """
    stem = os.path.splitext(os.path.basename(inv.source or ""))[0]
    prefix = f"{inv.odir}/" if inv.odir else ""
    if inv.output is None:
        inv.output = prefix + stem + _SUFFIX[inv.mode or "c"]
        inv.target = prefix + stem + ".o"
    else:
        inv.target = inv.output
    if inv.depmode is not None and inv.depfile is None:
        if inv.output_given:
            inv.depfile = os.path.splitext(inv.output)[0] + ".d"
        else:
            inv.depfile = prefix + stem + ".d"


_NOT_FOR_DEPS = {
    "--output-file",
    "--output-directory",
    "--generate-dependencies-with-compile",
    "--generate-nonsystem-dependencies-with-compile",
    "--dependency-output",
    "--dependency-target-name",
    "--generate-dependency-targets",
}


def without_outputs(args: list[str]) -> list[str]:
    """``args`` less their outputs, dependency options and compilation modes."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        split = split_option(token) if token.startswith("-") and token != "-" else None
        if split is None:
            out.append(token)
            continue
        name, value = split
        kind, role = OPTIONS[name][1], OPTIONS[name][2]
        takes_next = kind == VALUE and value is None
        if name in _NOT_FOR_DEPS or (role or "").startswith("mode:"):
            i += 1 if takes_next else 0
            continue
        out.append(token)
        if takes_next and i < len(args):
            out.append(args[i])
            i += 1
    return out


def dependency_only(args: list[str]) -> list[str]:
    """``args`` turned into an ``nvcc -M`` run printing every dependency to stdout."""
    return [*without_outputs(args), "-M"]
