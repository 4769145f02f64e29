"""Reading one entry file of the disk tier: bounded before any allocation, verified whole.

The hit path of :meth:`DiskStore.get`, and the check ``kernelcache verify``
runs on every entry (the entry file, then its extracted copies).
"""

from __future__ import annotations

import functools
import os
import stat
from typing import TYPE_CHECKING

from kernelcache.entry import Entry
from kernelcache.entry_format import header_size, unpack_from
from kernelcache.errors import CorruptEntry
from kernelcache.stores.base import Damage, EntryInfo
from kernelcache.stores.disk.layout import OPEN_READ, Layout, shard_of

if TYPE_CHECKING:
    from kernelcache.stores.disk.files import Extractor
    from kernelcache.stores.disk.pack import Packs

#: Entries up to this size are read in one call (a cubin of a few KB: the
#: common case) and their artifacts sliced out of it. Of larger ones, the
#: first _HEAD_READ bytes (the header, usually a few hundred bytes) come
#: first and then each artifact straight into its own bytes object: copying
#: 8 KB of a big artifact twice costs more (~0.6 us at 64 KB) than it saves.
_FIRST_READ = 8192
_HEAD_READ = 2048
#: An entry file at least this large whose allocated blocks are under 1/64 of
#: its size is sparse: never written by the tier, and reading it would
#: allocate its claimed size (a 100 GiB header over a hole). A miss instead.
_SPARSE_MIN = 1 << 20
_S_ISREG = stat.S_ISREG


def read_entry(
    fd: int, st: os.stat_result | None, key: str, files: Extractor | None
) -> tuple[Entry, int]:
    """The verified entry in the open file ``fd`` and its size; :class:`CorruptEntry` if
    it is not one.

    ``st`` is the file's status, or ``None`` to skip the ``fstat`` where the
    file turns out small (published entry files never change, so the bytes
    one read returns are its size). Three system calls in all with the
    caller's open and close for a small entry: one read, its artifacts
    sliced out of it. Of a large one, every artifact is read once, into the
    bytes object handed out, then hashed once while it is still in the CPU's
    cache.
    """
    if st is None:
        try:
            head = os.pread(fd, _FIRST_READ, 0)
        except IsADirectoryError:
            raise CorruptEntry("not a regular file") from None
        size = len(head)
        if size < _FIRST_READ:
            recorded, meta_raw, artifacts = unpack_from(head, size, key)
            return Entry.from_verified(artifacts, meta_raw, recorded, files), size
        st = os.fstat(fd)
    size = st.st_size
    if not _S_ISREG(st.st_mode):
        raise CorruptEntry("not a regular file")
    # unpack_from checks every size against the file's real one before reading.
    if size <= _FIRST_READ:
        head = os.pread(fd, size, 0)
        recorded, meta_raw, artifacts = unpack_from(head, size, key)
        return Entry.from_verified(artifacts, meta_raw, recorded, files), size
    if size >= _SPARSE_MIN and 0 < st.st_blocks * 512 < size // 64:
        raise CorruptEntry(f"entry file is sparse ({st.st_blocks * 512} of {size} bytes)")
    head = os.pread(fd, _HEAD_READ, 0)
    need = header_size(head)
    if len(head) < need <= size:  # a long header (big metadata): read all of it
        head = os.pread(fd, need, 0)
    recorded, meta_raw, artifacts = unpack_from(head, size, key, functools.partial(os.pread, fd))
    return Entry.from_verified(artifacts, meta_raw, recorded, files), size


def info_of(key: str, st: os.stat_result, path: str, extracted: int) -> EntryInfo:
    """What listings say of an entry. The size is what the cap counts (prune relies on
    it): the entry file plus its extracted copies, ``extra["extracted"]`` of it copies."""
    extra = {"ino": st.st_ino, "path": path, "extracted": extracted}
    return EntryInfo(key, st.st_size + extracted, st.st_mtime, st.st_ctime, extra)


def check_entry(layout: Layout, files: Extractor, info: EntryInfo) -> Damage | None:
    """Why the entry ``info`` names is damaged (its file, or an extracted copy), or ``None``.

    The damage describes the very file that was read, so removing it never
    takes an entry published since. A copy that differs from the verified
    bytes makes the entry damaged: removing it removes its copies too.
    """
    path = layout.entry_path(info.key)
    try:
        fd = os.open(path, OPEN_READ)
    except FileNotFoundError:
        return None  # removed meanwhile: nothing to check
    except OSError as exc:
        return Damage(info, f"cannot be read: {exc}")
    try:
        st = os.fstat(fd)
        checked = info_of(info.key, st, path, info.extra.get("extracted", 0))
        entry, _ = read_entry(fd, st, info.key, None)
    except CorruptEntry as exc:
        return Damage(checked, str(exc))
    except OSError as exc:
        return Damage(checked, f"cannot be read: {exc}")
    finally:
        os.close(fd)
    problems = files.check(entry, info.key)
    if problems:
        return Damage(checked, "; ".join(f"{where}: {what}" for where, what in problems))
    return None


def check_packed(packs: Packs | None, files: Extractor, info: EntryInfo) -> Damage | None:
    """Why the packed entry ``info`` names is damaged (its record, or an extracted copy), or
    ``None``; a record replaced or removed since ``info`` was taken is not checked."""
    if packs is None:
        return None
    record = info.extra.get("record", -1)
    raw = packs.raw(info.key, shard_of(info.key), record, info.extra.get("clock_ns"))
    if raw is None:
        return None
    try:
        recorded, meta_raw, artifacts = unpack_from(raw, len(raw), info.key)
    except CorruptEntry as exc:
        return Damage(info, str(exc))
    entry = Entry.from_verified(artifacts, meta_raw, recorded, None)
    problems = files.check(entry, info.key)
    if problems:
        return Damage(info, "; ".join(f"{where}: {what}" for where, what in problems))
    return None
