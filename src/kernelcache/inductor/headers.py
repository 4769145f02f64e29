"""The header part of a C++ build's key: its directives preprocessed, memoised like ccache's direct mode.

Preprocessing a kernel's ``#include`` lines with its flags (``g++ -E -P
-fdirectives-only``) gives a text that holds every header the compile can
reach; its SHA-256 is the key's header field. That costs a compiler run
(~0.1 s quiet, ~1 s on a loaded machine), once per (compiler, flags,
directives) in a process; all kernels of a model share one.

The same run writes the list of headers it read (``-MD``). A memo records
the digest with each header's stat signature (:func:`kernelcache._fs.signature`)
and the include lookups that found nothing (:func:`kernelcache.nvcc.includes.absent`,
in the compiler's own folders too), so the next process on this machine (and
the next build of this one) checks a few hundred ``stat`` calls instead of
running the preprocessor. The memo is machine-local by its key (host
and boot), never trusted for a header too new to vouch for
(:func:`kernelcache._fs.too_new`), and only a speed-up: a mismatch or an
unreadable record means a scan.

Each digest comes with the headers it covers (:class:`Scan`): the manifests of
:mod:`kernelcache.inductor.cpp_manifest` record them, so that a later lookup,
on any machine, needs no scan at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kernelcache import _fs
from kernelcache.keys import KeyBuilder
from kernelcache.nvcc import includes
from kernelcache.nvcc.includes import SearchPath

__all__ = ["HeaderScans", "Scan", "Uncacheable", "dependencies"]

_TIMEOUT = 300.0

#: Looks up and stores a memo record by key (bytes, or None when absent).
Load = Callable[[str], "bytes | None"]
Save = Callable[[str, bytes], None]


class Uncacheable(Exception):
    """This build cannot be keyed soundly; it runs as torch would, uncached."""


def dependencies(text: str) -> list[str]:
    """The files of a make rule written by ``-MD`` (escaped spaces kept), target excluded."""
    words = text.replace("\\\n", " ").replace("\\ ", "\0").split()
    return [w.replace("\0", " ") for w in words[1:] if w != "-"]


@dataclass(frozen=True)
class Scan:
    """The header field of a key, and what it was read from.

    ``files``: the headers the preprocessor read (absolute paths), ``None`` when
    they are not known exactly (a relative path, an unreadable ``-MD`` file);
    ``started_ns``: when the headers were last seen as the digest has them (the
    scan's start, or the memo's check): a header changed since is no part of it;
    ``builtin``: the folders the compiler searches of its own (``g++ -v``'s
    search list: ``/usr/local/include``, ``/usr/include``, its own), real paths,
    which a header created there may shadow as in any ``-I`` folder.
    """

    digest: str
    files: tuple[str, ...] | None
    started_ns: int
    builtin: tuple[str, ...] = ()

    def search(self, search: SearchPath) -> SearchPath:
        """``search`` with :attr:`builtin` in it (every folder of a lookup is watched)."""
        both = [*search.both, *self.builtin]
        return SearchPath(search.quote, both, search.pre, search.unsure)


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class HeaderScans:
    """Digests of preprocessed directives, per (compiler, flags, directives).

    Thread-safe: threads compiling the kernels of one model wait for one scan.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Each scan with its record (the headers' signatures; None: too new to vouch for).
        self._memo: dict[tuple[str, tuple[str, ...], str, str], tuple[Scan, bytes | None]] = {}
        self._busy: dict[tuple[str, tuple[str, ...], str, str], threading.Lock] = {}
        self.runs = 0
        self.machine = f"{os.uname().nodename}\0{_boot()}"

    def digest(
        self,
        compiler: str,
        identity: str,
        flags: list[str],
        text: str,
        memo: tuple[Load, Save] | None = None,
        folder: str | None = None,
        search: SearchPath | None = None,
    ) -> Scan:
        """The digest for ``compiler`` (a path; ``identity`` names it in memo keys).

        ``folder``: where the text's quoted includes are looked up (the source's
        folder, as the compile does: the scan reads the text on stdin, whose
        quoted lookups start in the working directory), ``None`` when it has none.
        ``search``: where the compile looks headers up
        (:func:`kernelcache.inductor.cpp_manifest.search_path`). A digest is
        remembered (in this process, and in ``memo``) only with it: it is used
        again while every header read keeps its signature and every lookup that
        found nothing still finds nothing (:func:`_recall`), else the headers
        are scanned again.
        """
        # The search path too: CPATH and the like search folders no flag names.
        lookups = None if search is None else (search.quote, search.both, search.pre)
        where = repr((folder, lookups))
        here = (compiler, tuple(flags), text, where)
        busy = self._lock_for(here)
        with busy:
            with self._lock:
                known = self._memo.get(here)
            started = time.time_ns()
            if known is not None:
                again = _recall(known[1], started)
                if again is not None:
                    return again
            key = (
                KeyBuilder("kernelcache.inductor.headers").add("machine", self.machine)
                .add("compiler", identity).add("flags", here[1]).add("text", text)
                .add("search", here[3]).hexdigest()
            )  # fmt: skip
            raw = memo[0](key) if memo is not None else None
            found = _recall(raw, started)
            if found is None:
                found, raw = self._scan(compiler, flags, text, started, folder, search)
                with self._lock:
                    self.runs += 1
                if memo is not None and raw is not None:
                    memo[1](key, raw)
            with self._lock:
                self._memo[here] = (found, raw)
            return found

    def _lock_for(self, here: tuple[str, tuple[str, ...], str, str]) -> threading.Lock:
        with self._lock:
            return self._busy.setdefault(here, threading.Lock())

    @staticmethod
    def _scan(
        compiler: str,
        flags: list[str],
        text: str,
        started: int,
        folder: str | None,
        search: SearchPath | None,
    ) -> tuple[Scan, bytes | None]:
        """The scan, and the memo record (None when a header is too new to vouch for).

        It runs in ``folder`` when given: g++ then finds the text's quoted
        includes there first, as the compile finds them beside the source, and
        names them relative to it in the ``-MD`` list (made absolute here).
        """
        with tempfile.TemporaryDirectory(prefix="kc-headers-") as tmp:
            deps = os.path.join(tmp, "deps")
            cmd = [compiler, "-x", "c++", *flags, "-E", "-P", "-fdirectives-only", "-v"]
            cmd += ["-MD", "-MF", deps, "-MT", "scan", "-", "-o", "-"]
            try:
                proc = subprocess.run(
                    cmd,
                    input=text.encode(),
                    capture_output=True,
                    timeout=_TIMEOUT,
                    check=False,
                    cwd=folder,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise Uncacheable(f"preprocessing the headers failed: {exc}") from exc
            if proc.returncode != 0:
                err = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
                raise Uncacheable(f"preprocessing the headers failed: {err}")
            digest = hashlib.sha256(proc.stdout).hexdigest()
            builtin = search_list(proc.stderr.decode("utf-8", "replace"))
            try:
                with open(deps) as f:
                    paths = dependencies(f.read())
            except OSError:
                return Scan(digest, None, started, builtin), None
        if folder is not None:
            paths = [os.path.join(folder, p) for p in paths]
        known = tuple(paths) if all(os.path.isabs(p) for p in paths) else None
        here = os.path.join(folder or os.getcwd(), "<directives>")
        scan = Scan(digest, known, started, builtin)
        if search is None:
            return scan, None
        return scan, _record(scan, paths, (here, text), scan.search(search))


def search_list(verbose: str) -> tuple[str, ...]:
    """The folders of the search lists ``g++ -v`` prints (real paths, in order)."""
    out: dict[str, None] = {}
    inside = False
    for line in verbose.splitlines():
        if line.startswith("#include ") and line.endswith("search starts here:"):
            inside = True
        elif line.startswith("End of search list."):
            inside = False
        elif inside and line.startswith(" "):
            folder = line.strip().removesuffix(" (framework directory)")
            out[os.path.realpath(folder)] = None
    return tuple(out)


def _record(
    scan: Scan, paths: list[str], directives: tuple[str, str], search: SearchPath
) -> bytes | None:
    """The memo record of a scan: its headers' signatures and the lookups that found
    nothing (:func:`kernelcache.nvcc.includes.absent`: a header created earlier in
    the search path changes the digest, and no signature of a header read); ``None``
    where they cannot all be vouched for."""
    now = time.time_ns()
    files = []
    contents = {directives[0]: directives[1].encode()}
    for path in paths:
        if not os.path.isabs(path):
            return None  # relative to a directory the next process may not share
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                contents[path] = f.read()
            if _fs.signature(os.stat(path)) != _fs.signature(st):
                return None
        except OSError:
            return None
        if _fs.too_new(st, now):
            return None
        files.append([path, list(_fs.signature(st))])
    try:
        missing = includes.absent(contents, search, scan.started_ns)
    except includes.Unsure:
        return None
    if missing is None:
        return None
    absent = includes.watch(missing, None)
    record = {"digest": scan.digest, "files": files, "absent": absent, "builtin": scan.builtin}
    return json.dumps(record).encode()


def _recall(raw: bytes | None, started: int) -> Scan | None:
    """The scan of a memo record whose headers all still have their signatures."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        digest, files, absent = str(record["digest"]), record["files"], record["absent"]
        builtin = tuple(str(folder) for folder in record["builtin"])
        for path, sig in files:
            if list(_fs.signature(os.stat(path))) != sig:
                return None
        paths = tuple(str(path) for path, _sig in files)
        if not includes.still_absent(absent, None):
            return None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OSError):
        return None  # damaged, or a header gone: scan again
    return Scan(digest, paths, started, builtin)
