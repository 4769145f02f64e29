"""Where key records are kept: in each stored entry's metadata, and as each family's last miss.

:func:`stamp` runs on every put (never on a hit): an entry stored under a
key this process built carries that key's fields (:data:`META_FIELD`) on
every tier it goes to. A compiled result (its metadata has
``compile_seconds``: it followed a miss) is also written, small, as its
family's last miss under ``<dir>/v1/explain/`` (one file per family,
replaced atomically), so that ``kernelcache explain --last-miss nvcc`` in
another process can tell why it compiled.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from typing import TYPE_CHECKING, Any

from kernelcache import _fs, _trust
from kernelcache.errors import CorruptEntry
from kernelcache.explain.fields import summary
from kernelcache.keys import family

if TYPE_CHECKING:
    from kernelcache.entry import Entry

__all__ = ["FAMILIES", "last_miss", "last_miss_path", "stamp"]

#: What ``--last-miss`` accepts -> the family its records are filed under.
FAMILIES = {
    "nvcc": "nvcc",
    "launcher": "nvcc",
    "nvrtc": "nvrtc",
    "cuda_core": "cuda_core",
    "triton": "triton",
    "tilelang": "tilelang",
    "ninetoothed": "ninetoothed",
    "inductor": "inductor",  # Inductor's C++ builds (kernelcache.inductor.cpp)
    "torch": "torch",  # torch.compile's FX graphs and AOTAutograd results (torch.compile/1)
    "torch.compile": "torch",
    "jax": "jax",
}
VERSION = 1
#: A last-miss file larger than this is damage (a record is a few KB).
MAX_RECORD_BYTES = 1 << 20
_NAME = re.compile(r"[a-z0-9_]{1,40}")


def explain_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, "v1", "explain")


def last_miss_path(cache_dir: str, kind: str) -> str:
    return os.path.join(explain_dir(cache_dir), f"last-miss-{kind}.json")


def stamp(key: str, entry: Entry, directory: str | None) -> Entry:
    """``entry`` carrying ``key``'s fields when this process built the key (else unchanged);
    a compiled result is also filed as its family's last miss in ``directory``."""
    record = summary(key)
    if record is None:
        return entry
    try:
        meta = entry.meta
        if entry.key_record is None:
            entry = entry.with_key_record(record)
    except CorruptEntry:
        return entry
    if directory is not None and "compile_seconds" in meta:
        _file_miss(directory, key, record, meta)
    return entry


def _file_miss(directory: str, key: str, record: dict[str, Any], meta: dict[str, Any]) -> None:
    kind = family(str(record["ns"]))
    doc = {
        "version": VERSION,
        "family": kind,
        "key": key,
        "name": meta.get("name"),
        "when": time.time(),
        "compile_seconds": meta.get("compile_seconds"),
        **record,
    }
    # A lost record costs an explanation, never a compile: I/O errors are dropped here
    # (by name), and an untrusted directory gets nothing (the tiers refuse it too).
    with contextlib.suppress(OSError, _trust.UntrustedDirectory):
        top = _trust.open_dir(directory)
        if top is None:  # removed meanwhile: not made again for a record
            return
        os.close(top)
        fd = _trust.open_dir(explain_dir(directory), create=True)
        if fd is None:
            return
        try:
            raw = json.dumps(doc, separators=(",", ":")).encode()
            _fs.write_atomic(f"last-miss-{kind}.json", raw, dir_fd=fd)
        finally:
            os.close(fd)


def last_miss(cache_dir: str, kind: str) -> dict[str, Any] | None:
    """The last miss filed for ``kind`` (a name of :data:`FAMILIES`), or ``None``.

    Raises ``ValueError`` for an unknown kind, or a record that is not one.
    """
    name = FAMILIES.get(kind, kind)
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"unknown integration {kind!r} for --last-miss; use one of {', '.join(FAMILIES)}"
        )
    path = last_miss_path(cache_dir, name)
    # Read as it was written: through the trusted directory (UntrustedDirectory if it is
    # not), never a link, a FIFO or a device planted there.
    folder = _trust.open_dir(explain_dir(cache_dir))
    if folder is None:
        return None
    try:
        fd = _trust.open_file(folder, os.path.basename(path), os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path} is not a last-miss record: not a regular file")
        raw = f.read(MAX_RECORD_BYTES + 1)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is not a last-miss record: {exc}") from exc
    if len(raw) > MAX_RECORD_BYTES or not isinstance(doc, dict) or "fields" not in doc:
        raise ValueError(f"{path} is not a last-miss record")
    return doc
