"""Dependency files and manifests for the nvcc launcher.

nvcc reports every file a compile read (``-MD -MF``, make syntax). The
launcher records them in a *manifest* stored under the *direct key* (compiler,
arguments, source content, environment): a list of variants, each the
dependency files with their content digests, the include lookups that found
nothing (:mod:`kernelcache.nvcc.includes`) and the key of the result they
produced. A later call with the same direct key checks the files of each
variant (a ``stat`` per file when its signature is unchanged, a content hash
otherwise) and, when all match, restores that result without running nvcc or
its preprocessor (ccache's "direct mode").
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from kernelcache import _fs
from kernelcache.keys import file_sha256 as _sha256
from kernelcache.keys import sha256
from kernelcache.nvcc.args import BASE_TOKEN, normalize_path

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from kernelcache.entry import Entry

#: Variants kept per manifest (newest first): enough for a few header states
#: per source, bounded so a manifest stays small.
MAX_VARIANTS = 8
#: A dependency whose mtime or ctime is this close to the compile's start may
#: have changed during the compile (timestamps are coarser than the clock):
#: the result is not cached (ccache: "include file modified during compilation").
RACE_SLOP_NS = 20_000_000
#: The manifest's one artifact: its variants as JSON.
MANIFEST = "manifest.json"


def parse_depfile(text: bytes) -> tuple[bytes, list[str]]:
    """``(target, dependencies)`` of the first rule of a make-style dependency file."""
    import re  # only a miss parses dependency files; a hit loads no regex

    joined = text.replace(b"\\\r\n", b" ").replace(b"\\\n", b" ")
    first = joined.split(b"\n", 1)[0]
    target, sep, rest = first.partition(b": ")
    if not sep:
        target, sep, rest = first.partition(b":")
    if not sep:
        raise ValueError("dependency file has no rule")
    deps = [_unescape(tok) for tok in re.findall(rb"(?:\\.|[^\s\\])+", rest)]
    return target.strip(), [os.fsdecode(d) for d in deps]


def _unescape(token: bytes) -> bytes:
    import re

    return re.sub(rb"\\(.)", rb"\1", token).replace(b"$$", b"$")


def strip_target(text: bytes, target: str) -> bytes | None:
    """The dependency file without its leading ``target``, or ``None`` if it does not start so."""
    prefix = os.fsencode(target)
    if text.startswith(prefix) and text[len(prefix) : len(prefix) + 1] in (b" ", b":"):
        return text[len(prefix) :]
    return None


def to_stored(text: bytes, basedir: str | None) -> bytes:
    """Replace ``basedir`` at the start of paths with a token (see ``from_stored``)."""
    if not basedir:
        return text
    import re

    prefix = re.escape(os.fsencode(basedir + os.sep))
    return re.sub(rb"(?<![^\s:])" + prefix, BASE_TOKEN.encode(), text)


def from_stored(text: bytes, basedir: str | None) -> bytes:
    """The dependency file as nvcc would have written it in this directory."""
    if BASE_TOKEN.encode() not in text:
        return text
    if not basedir:
        raise ValueError("stored dependency file needs KERNELCACHE_BASEDIR")
    return text.replace(BASE_TOKEN.encode(), os.fsencode(basedir + os.sep))


def signature(st: os.stat_result) -> list[int]:
    """``_fs.signature`` as stored in a manifest (JSON: a list)."""
    return list(_fs.signature(st))


def resolve(stored: str, basedir: str | None) -> str | None:
    """The real path of a dependency as recorded (``None`` if it needs a basedir we lack)."""
    if stored.startswith(BASE_TOKEN):
        return os.path.join(basedir, stored[len(BASE_TOKEN) :]) if basedir else None
    return stored


def record(
    deps: Sequence[str], basedir: str | None, started_ns: int
) -> tuple[list[list[Any]], dict[str, bytes]] | None:
    """Digest every dependency after a compile: ``(rows, contents)``; ``None`` if one changed.

    ``contents`` maps each dependency to the bytes that were hashed, for the
    scans of :mod:`kernelcache.nvcc.includes`.
    """
    rows: list[list[Any]] = []
    contents: dict[str, bytes] = {}
    now = time.time_ns()
    for path in dict.fromkeys(deps):
        known = _read(path, now)
        if known is None:
            return None
        st, digest, data = known
        if max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns - RACE_SLOP_NS:
            return None
        # A file changed too recently is recorded without a signature: the next
        # lookup hashes it (ccache's "file too new").
        sig = None if _fs.too_new(st, now) else signature(st)
        rows.append([normalize_path(path, basedir), digest, sig])
        contents[path] = data
    return rows, contents


#: The content and digest of dependencies this process recorded, by path and stat
#: signature. The launcher's server records compile after compile of the same
#: headers (a CUDA source reaches ~190 of them, 20 ms of reading and hashing); a
#: file whose signature is old enough to vouch for it (``_fs.too_new``) is read once.
#: The same bytes objects then hit :mod:`kernelcache.nvcc.includes`' scans at once.
_RECORDED: dict[str, tuple[tuple[int, int, int, int, int], str, bytes]] = {}
_RECORDED_MAX_BYTES = 64 << 20
_recorded_bytes = 0


def _read(path: str, now: int) -> tuple[os.stat_result, str, bytes] | None:
    """``(stat, digest, content)`` of one dependency; ``None`` if it changed while read."""
    global _recorded_bytes
    st = os.stat(path)
    where = os.path.abspath(path)
    known = _RECORDED.get(where)
    if known is not None and known[0] == _fs.signature(st):
        return st, known[1], known[2]
    with open(path, "rb") as f:
        data = f.read()
    after = os.stat(path)
    if _fs.signature(st) != _fs.signature(after):
        return None
    digest = sha256(data).hexdigest()
    if not _fs.too_new(after, now):
        replaced = _RECORDED.pop(where, None)
        _recorded_bytes -= 0 if replaced is None else len(replaced[2])
        if _recorded_bytes + len(data) > _RECORDED_MAX_BYTES:
            _RECORDED.clear()
            _recorded_bytes = 0
        _RECORDED[where] = (_fs.signature(after), digest, data)
        _recorded_bytes += len(data)
    return after, digest, data


def unchanged(st: os.stat_result, sig: Sequence[int] | None) -> bool:
    """Whether ``st`` has the recorded signature (``None``: never recorded, so no).

    Field by field, the likeliest to differ first: one call per dependency (and
    per watched directory, :mod:`kernelcache.tilelang.manifest`) on every hit.
    """
    return (
        sig is not None
        and st.st_mtime_ns == sig[3]
        and st.st_ino == sig[1]
        and st.st_size == sig[2]
        and st.st_ctime_ns == sig[4]
        and st.st_dev == sig[0]
    )


def matches(rows: Sequence[Sequence[Any]], basedir: str | None) -> bool:
    """Whether every recorded dependency still has its recorded content."""
    stat = os.stat
    for stored, digest, sig in rows:
        path = resolve(stored, basedir) if basedir or stored.startswith(BASE_TOKEN) else stored
        if path is None:
            return False
        try:
            st = stat(path)
            if unchanged(st, sig):
                continue
            if _digest(path, st) != digest:
                return False
        except OSError:
            return False
    return True


#: Digests of files this process hashed, by path and stat signature. A
#: long-lived process (the launcher's server) then hashes a file recorded as
#: "too new" once, not on every lookup, as long as its signature is old
#: enough to trust (``_fs.too_new``).
_DIGESTS: dict[str, tuple[list[int], str]] = {}
_DIGESTS_MAX = 65536


def _digest(path: str, st: os.stat_result) -> str:
    sig = signature(st)
    known = _DIGESTS.get(os.path.abspath(path))
    if known is not None and known[0] == sig:
        return known[1]
    digest = _sha256(path)
    if not _fs.too_new(st, time.time_ns()):
        if len(_DIGESTS) >= _DIGESTS_MAX:
            _DIGESTS.clear()
        _DIGESTS[os.path.abspath(path)] = (sig, digest)
    return digest


def add_variant(
    variants: list[dict[str, Any]],
    rows: list[list[Any]],
    absent: list[list[Any]],
    result: str,
    folder: str | None = None,
) -> list[dict[str, Any]]:
    """``variants`` with this one first and older ones with the same dependencies (and
    ``folder``: a result for one source folder only, :mod:`kernelcache.nvcc.key`) dropped."""

    def contents(variant: dict[str, Any]) -> tuple[list[list[Any]], Any]:
        return [list(row[:2]) for row in variant.get("deps", [])], variant.get("folder")

    new: dict[str, Any] = {"deps": rows, "absent": absent, "result": result}
    if folder is not None:
        new["folder"] = folder
    kept = [v for v in variants if contents(v) != contents(new)]
    return [new, *kept][:MAX_VARIANTS]


def variants(manifest: Entry | None) -> list[dict[str, Any]]:
    """The variants recorded in a manifest entry (none for a missing or damaged one)."""
    if manifest is None:
        return []
    try:
        found = json.loads(manifest[MANIFEST])
    except (KeyError, ValueError, RecursionError):
        return []  # a foreign or damaged manifest is a miss
    if not isinstance(found, list):
        return []
    # A variant of another shape (damaged, foreign, or recorded before failed include
    # lookups were: no "absent", which could hide a header created earlier in the
    # search path) is dropped here, so that no reader of one raises.
    return [v for v in found if _valid(v)]


def _valid(variant: object) -> bool:
    """Whether ``variant`` has the shape :func:`add_variant` gives it."""
    if not isinstance(variant, dict):
        return False
    rows, absent, result = variant.get("deps"), variant.get("absent"), variant.get("result")
    return (
        type(rows) is list
        and type(absent) is list
        and type(result) is str
        and type(variant.get("folder", "")) is str
        and all(
            type(row) is list
            and len(row) == 3
            and type(row[0]) is str
            and type(row[1]) is str
            and _signature(row[2])
            for row in rows
        )
        and all(
            type(group) is list
            and len(group) == 3
            and type(group[0]) is str
            and _signature(group[1])
            and type(group[2]) is list
            and all(type(name) is str for name in group[2])
            for group in absent
        )
    )


def _signature(value: object) -> bool:
    # Only the shape: a foreign value in it compares unequal, and the content decides.
    return value is None or (type(value) is list and len(value) == 5)
