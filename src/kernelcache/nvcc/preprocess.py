"""nvcc's own preprocessing of a compile, for the launcher's preprocessed key.

``nvcc --dryrun`` prints the commands nvcc would run for this very compile;
its preprocessing steps are the host compiler runs with ``-E``: one for the
host side and one per device architecture (``-D__CUDA_ARCH__=900``). They
are run as printed, with their output to a pipe instead of a temporary file,
and their outputs are hashed host first, then by architecture. Two compiles that preprocess the same
(a header differing only in a comment or in spaces within a line) then get
the same key (ccache's "preprocessor mode", as its fallback after a direct
miss). Line markers are kept: they reach warnings and debug info. With
``KERNELCACHE_BASEDIR`` its absolute prefix is replaced by a token, as in
keyed arguments.

Used on a direct-mode miss, before compiling: it costs a dry run and one
preprocessor run per pass, the passes side by side. A command never stored
under a preprocessed key before skips that (nothing could be found): it
compiles with ``--keep`` into a temporary directory and hashes the files
nvcc's own passes left there (:func:`kept_files`).
"""

from __future__ import annotations

import os
from hashlib import sha256

from kernelcache.nvcc import procs
from kernelcache.nvcc.args import BASE_TOKEN, without_outputs

# Not typing.TYPE_CHECKING, nor re, shlex or subprocess: an edit-and-rebuild's caller
# imports this module (kernelcache.nvcc.compiling), and they cost it ~25 ms (issue 23).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from kernelcache.nvcc.args import Invocation

#: Variables of the dry run's preamble that the preprocessing commands need.
_ENV_FROM_DRYRUN = ("PATH", "LD_LIBRARY_PATH")
_TIMEOUT = 600


def _dryrun(
    nvcc: str, args: list[str], env: Mapping[str, str]
) -> tuple[list[list[str]], dict[str, str]] | None:
    """The ``-E`` steps nvcc prints for ``args`` (with ``--dryrun``) and their environment."""
    ran = procs.run([nvcc, *args, "--dryrun"], env, timeout=_TIMEOUT)
    if ran is None or ran[0] != 0:
        return None
    return read_dryrun(ran[2], env)


def read_dryrun(
    printed: bytes, env: Mapping[str, str]
) -> tuple[list[list[str]], dict[str, str]] | None:
    """The ``-E`` steps and their environment in what ``nvcc --dryrun`` printed (its stderr)."""
    run_env = dict(env)
    found: list[list[str]] = []
    for raw in printed.decode("utf-8", "surrogateescape").splitlines():
        if not raw.startswith("#$ "):
            continue
        line = raw[3:].strip()
        name = line.partition("=")[0]
        assignment = "=" in line and name.isascii() and name.isidentifier()
        if not assignment and " -E " not in line and '"-E"' not in line:
            continue  # neither a variable nor a preprocessing step: not split
        try:
            words = split(line)
        except ValueError:
            return None  # a line we cannot read: no preprocessed key rather than a wrong one
        if len(words) == 1 and assignment:
            name, _, value = words[0].partition("=")
            if name in _ENV_FROM_DRYRUN:
                run_env[name] = value
        elif "-E" in words and "-o" in words[:-1]:
            found.append(words)
    # nvcc orders the passes differently with and without -MD or --keep: host
    # first, then each architecture in order, so every plan hashes alike.
    found.sort(key=_arch)
    return (found, run_env) if found else None


def _arch(words: list[str]) -> str:
    """The ``__CUDA_ARCH__`` a preprocessing pass defines; ``""`` for the host pass."""
    for word in words:
        if word.startswith("-D__CUDA_ARCH__="):
            return word.partition("=")[2].rjust(8, "0")
    return ""


def dryrun_args(inv: Invocation) -> list[str]:
    """The arguments whose dry run prints this compile's preprocessing: the same compile,
    writing nothing (outputs and dependency options removed)."""
    return [*without_outputs(inv.args), *inv.modes, "-o", os.devnull]


def commands(
    nvcc: str, inv: Invocation, env: Mapping[str, str]
) -> tuple[list[list[str]], dict[str, str]] | None:
    """The preprocessing commands of this compile and their environment, or ``None``."""
    return _commands(nvcc, dryrun_args(inv), env)


def _commands(
    nvcc: str, args: list[str], env: Mapping[str, str]
) -> tuple[list[list[str]], dict[str, str]] | None:
    planned = _dryrun(nvcc, args, env)
    if planned is None:
        return None
    steps, run_env = planned
    found = []
    for words in steps:
        i = words.index("-o")
        found.append(words[:i] + words[i + 2 :])
    return found, run_env


def kept_files(
    nvcc: str, args: list[str], keep_dir: str, env: Mapping[str, str]
) -> list[str] | None:
    """The files the preprocessing steps of ``nvcc args`` write into ``keep_dir``, in order.

    A compile run with ``--keep --keep-dir keep_dir`` leaves them there: the
    same steps as :func:`commands` (only their ``-o`` differs), so hashing them
    with :func:`hash_output` gives the same digests without preprocessing twice.
    """
    return kept_in(_dryrun(nvcc, keep_args(args, keep_dir), env), keep_dir)


def keep_args(args: list[str], keep_dir: str) -> list[str]:
    """``args`` keeping nvcc's intermediate files in ``keep_dir``."""
    return [*args, "--keep", "--keep-dir", keep_dir]


def kept_in(
    planned: tuple[list[list[str]], dict[str, str]] | None, keep_dir: str
) -> list[str] | None:
    """The files the steps of a ``--keep`` dry run write, if all of them go to ``keep_dir``."""
    if planned is None:
        return None
    files = [words[words.index("-o") + 1] for words in planned[0]]
    return files if all(os.path.dirname(f) == keep_dir for f in files) else None


def hash_output(text: bytes, basedir: str | None) -> str:
    """The digest of one preprocessed output (the basedir prefix as a token)."""
    if basedir:
        text = text.replace(os.fsencode(basedir + os.sep), BASE_TOKEN.encode())
    return sha256(text).hexdigest()


def digests(
    nvcc: str, inv: Invocation, env: Mapping[str, str], basedir: str | None
) -> list[str] | None:
    """SHA-256 of each preprocessed output (host, then by architecture); ``None`` if unavailable."""
    return digests_of(nvcc, dryrun_args(inv), env, basedir)


def digests_of(
    nvcc: str, args: list[str], env: Mapping[str, str], basedir: str | None
) -> list[str] | None:
    """:func:`digests` from :func:`dryrun_args` (a client of the launcher's server has
    no parsed invocation: the server sends these)."""
    planned = _commands(nvcc, args, env)
    if planned is None:
        return None
    found, run_env = planned
    outputs = run_all(found, run_env)
    if outputs is None:
        return None
    return [hash_output(text, basedir) for text in outputs]


def run_all(steps: list[list[str]], env: Mapping[str, str]) -> list[bytes] | None:
    """The stdout of each step, run side by side (as many at once as there are CPUs);
    ``None`` if one fails.

    A direct miss waits for these before it compiles: one after the other, the host
    pass and one pass per architecture cost their sum (2 x ~0.13 s for a small
    kernel, issue 23), where an edit-and-rebuild of one file leaves cores idle.
    """
    ran = procs.run_all(steps, env, limit=os.cpu_count() or 1, timeout=_TIMEOUT)
    outputs = [result[1] for result in ran if result is not None and result[0] == 0]
    return outputs if len(outputs) == len(steps) else None  # else the compile will say why


#: What separates words on a command line nvcc prints (``shlex``'s whitespace).
_BLANKS = " \t\r\n"


def split(line: str) -> list[str]:
    """The words of a POSIX shell command line, exactly as ``shlex.split`` gives them:
    quotes, and backslashes outside single quotes (within double quotes, only before
    ``\\`` or ``"``). ``ValueError`` for an unclosed quote or a trailing backslash.
    """
    words: list[str] = []
    word: list[str] = []
    started = False  # a word begun, if only by an empty pair of quotes
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in _BLANKS:
            if started:
                words.append("".join(word))
                word, started = [], False
            i += 1
            continue
        started = True
        if c == "\\":
            if i + 1 == n:
                raise ValueError("No escaped character")
            word.append(line[i + 1])
            i += 2
        elif c == "'":
            end = line.find("'", i + 1)
            if end < 0:
                raise ValueError("No closing quotation")
            word.append(line[i + 1 : end])
            i = end + 1
        elif c == '"':
            i += 1
            while True:
                end = min(
                    (j for j in (line.find('"', i), line.find("\\", i)) if j >= 0), default=-1
                )
                if end < 0:
                    raise ValueError("No closing quotation")
                word.append(line[i:end])
                if line[end] == '"':
                    i = end + 1
                    break
                if end + 1 < n and line[end + 1] in '"\\':
                    word.append(line[end + 1])
                    i = end + 2
                else:
                    word.append("\\")
                    i = end + 1
        else:
            end = i + 1
            while end < n and line[end] not in _BLANKS and line[end] not in "\\'\"":
                end += 1
            word.append(line[i:end])
            i = end
    if started:
        words.append("".join(word))
    return words
