"""The launcher's keys: what a cached nvcc result depends on.

- The *command key* holds everything known without reading the sources:
  nvcc's identity (``--version`` and content hashes, memoised by stat), the
  host compiler's identity (``-ccbin``, ``NVCC_CCBIN`` or ``gcc`` on ``PATH``:
  nvcc preprocesses with it), the normalised arguments (outputs removed), the
  environment variables nvcc and gcc read (:data:`ENV_VARS`) and those its
  ``nvcc.profile`` reads (:func:`profile_variables`), the working
  directory when debug info names it, and the sloppiness the user allowed.
- The *direct key* adds the source's content. A manifest under it maps
  dependency states to results (:mod:`kernelcache.nvcc.deps`).
- The *preprocessed key* adds nvcc's own preprocessed output instead (host
  and every device pass, :mod:`kernelcache.nvcc.preprocess`), so that an edit
  that preprocesses the same (a comment, spaces) finds the same result.
- Without a preprocessed key (a source nvcc does not preprocess), a result is
  stored under the direct key plus the content of every dependency.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from kernelcache.nvcc.args import Invocation

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

#: Environment variables that change what nvcc (or the gcc it runs) produces.
#: PATH itself is not keyed: the compilers it resolves to are, by identity.
ENV_VARS = (
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "NVCC_CCBIN",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "SOURCE_DATE_EPOCH",
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def environment(env: Mapping[str, str]) -> dict[str, str | None]:
    """What a key holds of the environment nvcc runs in: :data:`ENV_VARS` (``None``: unset).

    Every integration that runs nvcc keys it so (the launcher, TileLang's and
    ninetoothed's compiles): ``NVCC_APPEND_FLAGS=-G`` or a ``CPATH`` header
    changes the binary while the command line stays the same.
    """
    return {name: env.get(name) for name in ENV_VARS}


def flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean launcher variable (``KERNELCACHE_HASH_DIR=0``); a bad value raises ``ValueError``."""
    text = env.get(name)
    if text is None:
        return default
    lowered = text.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ValueError(f"{name} must be one of 1/0, true/false, yes/no, on/off; got {text!r}")


def sloppiness(env: Mapping[str, str]) -> frozenset[str]:
    """``KERNELCACHE_SLOPPINESS`` (one reading for every integration: :mod:`kernelcache.sloppiness`)."""
    from kernelcache.sloppiness import sloppiness as read

    return read(env)


def which(name: str, env: Mapping[str, str]) -> str | None:
    """``name`` on the ``PATH`` of ``env`` (the caller's environment, not the server's)."""
    return shutil.which(name, path=env.get("PATH", os.defpath))


def resolve_compiler(name: str, env: Mapping[str, str]) -> str:
    return name if os.sep in name else (which(name, env) or name)


def host_compiler(inv: Invocation, env: Mapping[str, str]) -> str | None:
    """The host compiler nvcc will run (``-ccbin``, ``NVCC_CCBIN``, else ``gcc``)."""
    value = inv.ccbin or env.get("NVCC_CCBIN") or "gcc"
    if os.path.isdir(value):
        return os.path.join(value, "gcc")  # what nvcc runs for a directory (checked, 13.0)
    return value if os.sep in value else which(value, env)


#: Modes whose output is device code alone, uncompressed: what it holds of the
#: source's folder can be read in it (a -c object's host code, a compressed fatbin cannot).
_PORTABLE_MODES = ("cubin", "ptx")


def portable_folder(inv: Invocation, env: Mapping[str, str]) -> str | None:
    """The source's folder when the keys may leave it out, else ``None`` (issue 37).

    DeepGEMM compiles each kernel as ``<cache>/tmp/<new uuid>/kernel.cu``: with
    the folder in the key, every rank and every run missed. Left out (keyed
    as a base directory, :func:`kernelcache.nvcc.args.normalize_path`) for a
    ``-cubin`` or ``-ptx`` compile of a source named by its absolute path,
    without debug info (``-g``, ``-G``, ``-lineinfo``: they name the folder)
    and without ``KERNELCACHE_BASEDIR`` (the user's choice stands). Whether the
    output then names the folder after all (``__FILE__``, ``__builtin_FILE``,
    ``source_location``, or the module id nvcc derives from the path for
    internal device symbols) is read in the output itself (:func:`names_folder`):
    such a result is stored for its folder alone.
    """
    source = inv.source or ""
    if inv.mode not in _PORTABLE_MODES or inv.debug or not os.path.isabs(source):
        return None
    if env.get("KERNELCACHE_BASEDIR") or source != os.path.normpath(source):
        # __FILE__ is the path as written: only a normal spelling is what names_folder
        # looks for in the output (/a/b/../c/k.cu would be found nowhere, and shared).
        return None
    folder = os.path.dirname(source)
    return folder if folder != os.sep else None


#: What nvcc derives from the source's path for internal-linkage device symbols
#: (``_ZN37_INTERNAL_7c146bb4_9_kernel_cu_...``: the hash changes with the folder).
_PATH_DERIVED = (b"_INTERNAL_", b"_GLOBAL__N_")


def names_folder(output: bytes, folder: str) -> bool:
    """Whether a device-code output depends on its source's ``folder`` (see :func:`portable_folder`)."""
    return os.fsencode(folder) in output or any(mark in output for mark in _PATH_DERIVED)


def pinned_key(key: str, folder: str) -> str:
    """Where a result that names its source's ``folder`` is stored: ``key``, for that folder only."""
    from kernelcache.keys import KeyBuilder

    return KeyBuilder("kernelcache.nvcc.pinned").add("key", key).add("folder", folder).hexdigest()


def names_directory(inv: Invocation, env: Mapping[str, str]) -> bool:
    """Whether the working directory is keyed: debug info names it, unless hash_dir is off."""
    hash_dir = flag(env, "KERNELCACHE_HASH_DIR", True)  # checked always: a typo must show
    return inv.debug and hash_dir


class Identities:
    """Toolchain identities a long-lived process (the server) already knows are unchanged.

    ``kernelcache.toolchain`` memoises an identity by the stat signatures of
    the files it depends on, but finding them again costs a ``realpath``, a
    read of the file's head and the memo file's settings on every call. Here
    those files (the compiler as named, the files a wrapper script names,
    nvcc's ``nvcc.profile``) are found once and re-checked by ``stat`` alone
    (``stat`` follows links: another target has another inode); an identity
    whose files are too new to vouch for their content is not remembered.
    """

    def __init__(self) -> None:
        self._known: dict[str, tuple[list[str], list[tuple[int, ...] | None], str]] = {}

    def nvcc(self, path: str) -> str:
        return self._get("nvcc", path, nvcc_identity)

    def executable(self, path: str) -> str:
        from kernelcache import toolchain

        return self._get("exe", path, toolchain.executable)

    def _get(self, kind: str, path: str, probe: Callable[[str], str]) -> str:
        known = self._known.get(kind + "\0" + path)
        if known is not None and [_stat_signature(f) for f in known[0]] == known[1]:
            return known[2]
        files = _identity_files(kind, path)
        sigs = [_stat_signature(f) for f in files]
        identity = probe(path)
        if not identity.startswith("probe_failed:") and _trustworthy(sigs):
            self._known[kind + "\0" + path] = (files, sigs, identity)
        return identity


def _identity_files(kind: str, path: str) -> list[str]:
    """The files ``toolchain.nvcc``/``toolchain.executable`` derive an identity from."""
    from kernelcache import _fs, toolchain

    try:
        targets = toolchain.script_targets(_fs.realpath(path))
    except OSError:
        targets = []
    files = [path, *targets]
    if kind == "nvcc":
        files += toolchain.nvcc_profiles(path, targets)
    return files


def _stat_signature(path: str) -> tuple[int, ...] | None:
    from kernelcache import _fs

    try:
        return _fs.signature(os.stat(path))
    except OSError:
        return None


def _trustworthy(sigs: list[tuple[int, ...] | None]) -> bool:
    import time

    from kernelcache._fs import TOO_NEW_NS

    now = time.time_ns()  # a signature too new does not vouch for the content (_fs.too_new)
    return sigs[0] is not None and all(
        s is None or now - max(s[3], s[4]) >= TOO_NEW_NS for s in sigs
    )


def command_key(
    nvcc: str, inv: Invocation, env: Mapping[str, str], known: Identities | None = None
) -> str:
    """Everything but the sources' content (see the module docstring)."""
    from kernelcache import toolchain
    from kernelcache.keys import KeyBuilder

    host = host_compiler(inv, env)
    nvcc_id = known.nvcc(nvcc) if known else nvcc_identity(nvcc)
    host_id = "probe_failed:FileNotFoundError"
    if host:
        host_id = known.executable(host) if known else toolchain.executable(host)
    builder = KeyBuilder("kernelcache.nvcc.command")
    builder.add("nvcc", nvcc_id)  # with the names its nvcc.profile reads (issue 19)
    builder.add("host", host_id)
    builder.add("args", inv.keyed)
    builder.add("env", environment(env))
    reads = nvcc_id.rpartition(_PROFILE_READS)[2].split(",") if _PROFILE_READS in nvcc_id else []
    builder.add("profile_env", {name: env.get(name) for name in reads if name})
    builder.add("cwd", os.getcwd() if names_directory(inv, env) else None)
    builder.add("sloppiness", sorted(sloppiness(env)))
    return builder.hexdigest()


def direct_key(command: str, source: bytes) -> str:
    from kernelcache.keys import KeyBuilder, sha256

    builder = KeyBuilder("kernelcache.nvcc.direct").add("command", command)
    return builder.add("source", sha256(source).digest()).hexdigest()


def preprocessed_key(command: str, digests: list[str]) -> str:
    from kernelcache.keys import KeyBuilder

    builder = KeyBuilder("kernelcache.nvcc.preprocessed").add("command", command)
    return builder.add("preprocessed", digests).hexdigest()


def seen_key(command: str) -> str:
    """The key of the mark that a result of this command was stored under a preprocessed key.

    Preprocessed keys include the command key, so without the mark no
    preprocessed result of this command can be found: a direct miss then skips
    the preprocessing pass (the mark only saves work; a lost mark costs one
    preprocessed hit, never a wrong one).
    """
    from kernelcache.keys import KeyBuilder

    return KeyBuilder("kernelcache.nvcc.seen").add("command", command).hexdigest()


def result_key(direct: str, rows: list[list[Any]]) -> str:
    """The key of a result nvcc could not preprocess: the direct key and every dependency."""
    from kernelcache.keys import KeyBuilder

    contents = [[str(stored), str(digest)] for stored, digest, _sig in rows]
    builder = KeyBuilder("kernelcache.nvcc.result").add("direct", direct)
    return builder.add("deps", contents).hexdigest()


PROFILE_NOT_KEYED = frozenset({"PATH"})
_PROFILE_READS = "\nprofile-reads:"


def nvcc_identity(nvcc: str) -> str:
    """nvcc's identity (:func:`kernelcache.toolchain.nvcc`) and the variables its profile reads.

    One string, so that the server's :class:`Identities` re-checks both with
    the same ``stat`` calls and a hit does no more work than before.
    """
    from kernelcache import toolchain

    identity = toolchain.nvcc(nvcc)
    if identity.startswith("probe_failed:"):
        return identity
    return identity + _PROFILE_READS + ",".join(profile_variables(nvcc))


def profile_variables(nvcc: str) -> tuple[str, ...]:
    """The environment variables the ``nvcc.profile`` of ``nvcc`` reads, sorted.

    nvcc reads the profile in the directory of the path it was run by (not
    through symlinks; a wrapper script's ``exec``'d nvcc reads its own:
    :func:`kernelcache.toolchain.nvcc_profiles`) and expands it against the
    environment: ``INCLUDES += ...`` starts from the caller's ``INCLUDES``,
    ``PTXAS_FLAGS`` reaches ptxas, a ``$(NAME)`` is read from the environment
    unless the profile sets it (issue 19). So every name the profile assigns
    or expands is keyed, whatever the profile says: no fixed list. Left out:
    ``PATH`` (the profile puts the toolkit's directories first, and the one
    program nvcc finds through the caller's ``PATH``, the host compiler, is
    keyed by identity; keying ``PATH`` would split a team's entries by shell
    set-up). Read on a miss of :class:`Identities` (by stat, in the server),
    else once per call of a fresh process.
    """
    from kernelcache import toolchain

    names: set[str] = set()
    for path in toolchain.nvcc_profiles(nvcc, _targets(nvcc)):
        try:
            with open(path, "rb") as f:
                names |= profile_names(f.read().decode("utf-8", "surrogateescape"))
        except OSError:
            continue  # no profile there: nvcc reads none either
    return tuple(sorted(names - PROFILE_NOT_KEYED))


def _targets(path: str) -> list[str]:
    from kernelcache import _fs, toolchain

    try:
        return toolchain.script_targets(_fs.realpath(path))
    except OSError:
        return []


def profile_names(text: str) -> set[str]:
    """Every name ``text`` assigns (``=``, ``+=``, ``=+``) or expands (``$(NAME)``, ``${NAME}``)."""
    names: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        left, eq, _ = line.partition("=")
        name = left.rstrip().rstrip("+").rstrip()
        if eq and name.isidentifier():
            names.add(name)
        for opener, closer in (("$(", ")"), ("${", "}")):
            at = line.find(opener)
            while at >= 0:
                end = line.find(closer, at + 2)
                if end < 0:
                    break
                inner = line[at + 2 : end].strip()
                if inner.isidentifier():
                    names.add(inner)
                at = line.find(opener, end)
    return names
