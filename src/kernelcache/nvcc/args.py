"""Understanding an nvcc command line: is it one cacheable compile, and what is its key?

The launcher caches exactly one shape: one source compiled with ``-c`` (or
``-dc``/``-dw``), ``-ptx``, ``-cubin`` or ``-fatbin`` into an explicit ``-o``,
with optional ``-MD``/``-MMD`` + ``-MF`` dependency files. Every option is
looked up in a table taken from ``nvcc --help`` (CUDA 13.0); anything else
(linking, several inputs, ``-E``, ``--dryrun``, options with side effects,
options not in the table) makes the call uncacheable with a reason, and nvcc
runs unchanged.

Path normalisation: relative paths are kept as written (they are relative to
the working directory already, so a copy of a project gives the same key).
Absolute paths are kept as written by default, because nvcc puts them into
outputs (``__FILE__``, debug info); with ``KERNELCACHE_BASEDIR=<dir>`` (like
ccache's ``base_dir``) absolute paths under that directory are keyed relative
to it, trading that exactness for hits across checkouts.
"""

from __future__ import annotations

import os

BASE_TOKEN = "\0BASE\0"

# Kinds: "flag" takes no value, "value" takes one.
# Roles: None (keyed verbatim), "mode:<m>", "uncacheable:<why>", "output",
# "depmode", "depfile", "deptarget", "path", "optfile", "ccbin", "debug".
_F, _V = "flag", "value"
_U = "uncacheable:"
OPTIONS: dict[str, tuple[str, str, str | None]] = {
    # long name: (short name, kind, role)
    "--compile": ("-c", _F, "mode:c"),
    "--device-c": ("-dc", _F, "mode:c"),
    "--device-w": ("-dw", _F, "mode:c"),
    "--ptx": ("-ptx", _F, "mode:ptx"),
    "--cubin": ("-cubin", _F, "mode:cubin"),
    "--fatbin": ("-fatbin", _F, "mode:fatbin"),
    "--cuda": ("-cuda", _F, _U + "-cuda output is not cached"),
    "--optix-ir": ("-optix-ir", _F, _U + "-optix-ir output is not cached"),
    "--ltoir": ("-ltoir", _F, _U + "-ltoir output is not cached"),
    "--preprocess": ("-E", _F, _U + "preprocessing (-E)"),
    "--generate-dependencies": ("-M", _F, _U + "dependency generation only (-M)"),
    "--generate-nonsystem-dependencies": ("-MM", _F, _U + "dependency generation only (-MM)"),
    "--generate-dependencies-with-compile": ("-MD", _F, "depmode"),
    "--generate-nonsystem-dependencies-with-compile": ("-MMD", _F, "depmode"),
    "--dependency-output": ("-MF", _V, "depfile"),
    "--generate-dependency-targets": ("-MP", _F, None),
    "--dependency-target-name": ("-MT", _V, "deptarget"),
    "--device-link": ("-dlink", _F, _U + "device linking"),
    "--link": ("-link", _F, _U + "linking"),
    "--lib": ("-lib", _F, _U + "building a library"),
    "--run": ("-run", _F, _U + "running the program"),
    "--output-file": ("-o", _V, "output"),
    "--pre-include": ("-include", _V, "path"),
    "--objdir-as-tempdir": ("-objtemp", _F, None),
    "--library": ("-l", _V, None),
    "--define-macro": ("-D", _V, None),
    "--undefine-macro": ("-U", _V, None),
    "--include-path": ("-I", _V, "path"),
    "--system-include": ("-isystem", _V, "path"),
    "--library-path": ("-L", _V, "path"),
    "--output-directory": ("-odir", _V, _U + "output directory (-odir)"),
    "--compiler-bindir": ("-ccbin", _V, "ccbin"),
    "--allow-unsupported-compiler": ("-allow-unsupported-compiler", _F, None),
    "--archiver-binary": ("-arbin", _V, None),
    "--cudart": ("-cudart", _V, None),
    "--cudadevrt": ("-cudadevrt", _V, None),
    "--libdevice-directory": ("-ldir", _V, "path"),
    "--target-directory": ("-target-dir", _V, None),
    "--use-local-env": ("-use-local-env", _F, None),
    "--force-cl-env-setup": ("-force-cl-env-setup", _F, None),
    "--profile": ("-pg", _F, None),
    "--debug": ("-g", _F, "debug"),
    "--device-debug": ("-G", _F, "debug"),
    "--generate-line-info": ("-lineinfo", _F, "debug"),
    "--optimization-info": ("-opt-info", _V, None),
    "--optimize": ("-O", _V, None),
    "--Ofast-compile": ("-Ofc", _V, None),
    "--dopt": ("-dopt", _V, None),
    "--dlink-time-opt": ("-dlto", _F, None),
    "--lto": ("-lto", _F, None),
    "--gen-opt-lto": ("-gen-opt-lto", _F, None),
    "--ftemplate-backtrace-limit": ("-ftemplate-backtrace-limit", _V, None),
    "--ftemplate-depth": ("-ftemplate-depth", _V, None),
    "--no-exceptions": ("-noeh", _F, None),
    "--shared": ("-shared", _F, None),
    "--x": ("-x", _V, None),
    "--std": ("-std", _V, None),
    "--no-host-device-initializer-list": ("-nohdinitlist", _F, None),
    "--no-host-device-move-forward": ("-nohdmoveforward", _F, None),
    "--expt-relaxed-constexpr": ("-expt-relaxed-constexpr", _F, None),
    "--extended-lambda": ("-extended-lambda", _F, None),
    "--expt-extended-lambda": ("-expt-extended-lambda", _F, None),
    "--machine": ("-m", _V, None),
    "--m64": ("-m64", _F, None),
    "--compiler-options": ("-Xcompiler", _V, None),
    "--linker-options": ("-Xlinker", _V, None),
    "--archive-options": ("-Xarchive", _V, None),
    "--ptxas-options": ("-Xptxas", _V, None),
    "--nvlink-options": ("-Xnvlink", _V, None),
    "--static-global-template-stub": ("-static-global-template-stub", _V, None),
    "--device-entity-has-hidden-visibility": ("-device-entity-has-hidden-visibility", _V, None),
    "--forward-unknown-to-host-compiler": ("-forward-unknown-to-host-compiler", _F, None),
    "--forward-unknown-to-host-linker": ("-forward-unknown-to-host-linker", _F, None),
    "--forward-unknown-opts": ("-forward-unknown-opts", _F, None),
    "--dont-use-profile": ("-noprof", _F, None),
    "--dryrun": ("-dryrun", _F, _U + "--dryrun"),
    "--verbose": ("-v", _F, _U + "--verbose describes this very run"),
    "--threads": ("-t", _V, None),
    "--split-compile": ("-split-compile", _V, None),
    "--split-compile-extended": ("-split-compile-extended", _V, None),
    "--fdevice-syntax-only": ("-fdevice-syntax-only", _F, None),
    "--fdevice-time-trace": ("-fdevice-time-trace", _V, _U + "--fdevice-time-trace writes a file"),
    "--keep": ("-keep", _F, _U + "--keep writes intermediate files"),
    "--keep-dir": ("-keep-dir", _V, _U + "--keep-dir writes intermediate files"),
    "--save-temps": ("-save-temps", _F, _U + "--save-temps writes intermediate files"),
    "--clean-targets": ("-clean", _F, _U + "--clean-targets deletes files"),
    "--time": ("-time", _V, _U + "--time writes a timing file"),
    "--run-args": ("-run-args", _V, _U + "running the program"),
    "--input-drive-prefix": ("-idp", _V, None),
    "--dependency-drive-prefix": ("-ddp", _V, None),
    "--drive-prefix": ("-dp", _V, None),
    "--no-align-double": ("--no-align-double", _F, None),
    "--no-device-link": ("-nodlink", _F, None),
    "--gpu-architecture": ("-arch", _V, None),
    "--gpu-code": ("-code", _V, None),
    "--generate-code": ("-gencode", _V, None),
    "--relocatable-device-code": ("-rdc", _V, None),
    "--entries": ("-e", _V, None),
    "--maxrregcount": ("-maxrregcount", _V, None),
    "--use_fast_math": ("-use_fast_math", _F, None),
    "--ftz": ("-ftz", _V, None),
    "--prec-div": ("-prec-div", _V, None),
    "--prec-sqrt": ("-prec-sqrt", _V, None),
    "--fmad": ("-fmad", _V, None),
    "--extra-device-vectorization": ("-extra-device-vectorization", _F, None),
    "--default-stream": ("-default-stream", _V, None),
    "--disable-warnings": ("-w", _F, None),
    "--keep-device-functions": ("-keep-device-functions", _F, None),
    "--source-in-ptx": ("-src-in-ptx", _F, "debug"),
    "--restrict": ("-restrict", _F, None),
    "--Wreorder": ("-Wreorder", _F, None),
    "--Wdefault-stream-launch": ("-Wdefault-stream-launch", _F, None),
    "--Wmissing-launch-bounds": ("-Wmissing-launch-bounds", _F, None),
    "--Wext-lambda-captures-this": ("-Wext-lambda-captures-this", _F, None),
    "--Wno-deprecated-declarations": ("-Wno-deprecated-declarations", _F, None),
    "--Wno-deprecated-gpu-targets": ("-Wno-deprecated-gpu-targets", _F, None),
    "--Werror": ("-Werror", _V, None),
    "--resource-usage": ("-res-usage", _F, None),
    "--extensible-whole-program": ("-ewp", _F, None),
    "--no-compress": ("-no-compress", _F, None),
    "--qpp-config": ("-qpp-config", _F, None),
    "--compile-as-tools-patch": ("-astoolspatch", _F, None),
    "--list-gpu-code": ("-code-ls", _F, _U + "--list-gpu-code"),
    "--list-gpu-arch": ("-arch-ls", _F, _U + "--list-gpu-arch"),
    "--display-error-number": ("-err-no", _F, None),
    "--no-display-error-number": ("-no-err-no", _F, None),
    "--diag-error": ("-diag-error", _V, None),
    "--diag-suppress": ("-diag-suppress", _V, None),
    "--diag-warn": ("-diag-warn", _V, None),
    "--host-linker-script": ("-hls", _V, None),
    "--augment-host-linker-script": ("-aug-hls", _F, None),
    "--relocatable-link": ("-r", _F, _U + "relocatable linking"),
    "--brief-diagnostics": ("-brief-diag", _V, None),
    "--jump-table-density": ("-jtd", _V, None),
    "--relocatable-ptx": ("-reloc-ptx", _F, None),
    "--device-stack-protector": ("-device-stack-protector", _V, None),
    "--compress-mode": ("-compress-mode", _V, None),
    "--frandom-seed": ("-frandom-seed", _V, None),
    "--sanitize": ("-sanitize", _V, None),
    "--jobserver": ("-jobserver", _F, None),
    "--help": ("-h", _F, _U + "--help"),
    "--version": ("-V", _F, _U + "--version"),
    "--options-file": ("-optf", _V, "optfile"),
}
_BY_NAME: dict[str, str] = {}
for _long, (_short, _kind, _role) in OPTIONS.items():
    _BY_NAME[_long] = _long
    _BY_NAME[_short] = _long
#: Single-letter short options whose value may be attached (``-Idir``, ``-O3``).
_ATTACHABLE = {s: n for n, (s, k, _) in OPTIONS.items() if k == _V and len(s) == 2}
SOURCE_SUFFIXES = (".cu", ".c", ".cc", ".cpp", ".cxx", ".C")
_MAX_OPTFILE_DEPTH = 8


class Invocation:
    """One parsed nvcc call. ``reason`` is set when it cannot be cached.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect``, a
    few milliseconds on a hit path bounded by interpreter start-up.
    """

    __slots__ = (
        "args",
        "ccbin",
        "debug",
        "depfile",
        "depmode",
        "deptarget",
        "keyed",
        "mode",
        "output",
        "reason",
        "source",
    )

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.mode: str | None = None
        self.source: str | None = None
        self.output: str | None = None
        self.depmode: str | None = None  # "-MD" or "-MMD"
        self.depfile: str | None = None
        self.deptarget = False
        self.ccbin: str | None = None
        self.debug = False
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


def _split(token: str) -> tuple[str, str | None] | None:
    """``(long name, attached value)`` for an option token, or ``None`` if unknown."""
    name, eq, value = token.partition("=")
    if name in _BY_NAME:
        return _BY_NAME[name], (value if eq else None)
    if token[:2] in _ATTACHABLE and len(token) > 2:
        return _ATTACHABLE[token[:2]], token[2:]
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
        split = _split(token) if token.startswith("-") else None
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


def parse(args: list[str], environ: os._Environ[str] | dict[str, str] | None = None) -> Invocation:
    """Classify an nvcc command line (``args`` without the compiler itself)."""
    env = os.environ if environ is None else environ
    inv = Invocation(args=list(args))
    basedir = env.get("KERNELCACHE_BASEDIR") or None
    basedir = os.path.normpath(os.path.abspath(basedir)) if basedir else None
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
        split = _split(token)
        if split is None:
            inv.refuse(f"unknown option {token}")
            continue
        name, value = split
        _short, kind, role = OPTIONS[name]
        if kind == _V and value is None:
            if i >= len(tokens):
                inv.refuse(f"option {token} is missing its value")
                break
            value = tokens[i]
            i += 1
        if kind == _F and value is not None:
            inv.refuse(f"option {name} takes no value")
        _apply(inv, name, value, role, basedir)
    _finish(inv, inputs, basedir)
    return inv


def _apply(
    inv: Invocation, name: str, value: str | None, role: str | None, basedir: str | None
) -> None:
    if role is None or role == "debug":
        inv.keyed.append([name, value])
        inv.debug = inv.debug or role == "debug"
        if name == "--compiler-options" and value and "-g" in value.replace(",", " ").split():
            inv.debug = True  # host debug info names the directory too
    elif role.startswith("uncacheable:"):
        inv.refuse(role.split(":", 1)[1])
    elif role.startswith("mode:"):
        if inv.mode is not None:
            inv.refuse("more than one compilation mode")
        inv.mode = role.split(":", 1)[1]
        inv.keyed.append([name, None])
    elif role == "output":
        if inv.output is not None:
            inv.refuse("more than one -o")
        inv.output = value
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
    elif role == "path":
        paths = [normalize_path(p, basedir) for p in (value or "").split(",")]
        inv.keyed.append([name, ",".join(paths)])


def _finish(inv: Invocation, inputs: list[str], basedir: str | None) -> None:
    if inv.mode is None:
        inv.refuse("not a -c, -ptx, -cubin or -fatbin compile")
    if len(inputs) != 1:
        inv.refuse(f"{len(inputs)} input files (one is cached)")
    elif not inputs[0].endswith(SOURCE_SUFFIXES) and not any(k[0] == "--x" for k in inv.keyed):
        inv.refuse(f"input {inputs[0]} is not a CUDA/C/C++ source")
    else:
        inv.source = inputs[0]
        inv.keyed.append(["<input>", normalize_path(inputs[0], basedir)])
    if inv.output is None:
        inv.refuse("no -o output file")
    if inv.depmode is not None and inv.depfile is None:
        inv.refuse("dependency file without -MF")
    if inv.depfile is not None and inv.depmode is None:
        inv.refuse("-MF without -MD/-MMD")


_NOT_FOR_DEPS = {
    "--output-file",
    "--generate-dependencies-with-compile",
    "--generate-nonsystem-dependencies-with-compile",
    "--dependency-output",
    "--dependency-target-name",
    "--generate-dependency-targets",
}


def dependency_only(args: list[str]) -> list[str]:
    """``args`` turned into an ``nvcc -M`` run printing every dependency to stdout."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        split = _split(token) if token.startswith("-") and token != "-" else None
        if split is None:
            out.append(token)
            continue
        name, value = split
        kind, role = OPTIONS[name][1], OPTIONS[name][2]
        takes_next = kind == _V and value is None
        if name in _NOT_FOR_DEPS or (role or "").startswith("mode:"):
            i += 1 if takes_next else 0
            continue
        out.append(token)
        if takes_next and i < len(args):
            out.append(args[i])
            i += 1
    return [*out, "-M"]
