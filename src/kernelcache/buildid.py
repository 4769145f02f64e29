"""The GNU build ID of an ELF file: the linker's digest of what it wrote.

``ld``, ``gold`` and ``lld`` (``--build-id``, on by default in most
toolchains) write a note holding a digest of the output's content (SHA-1,
MD5 or xxHash): a rebuilt library gets a new one, a bit-identical rebuild
the same one. debuginfod, ``perf`` and gdb name binaries by it. Reading it
costs one small read of the program headers and notes, where hashing
TileLang's ~100 MB of libraries costs ~0.1 s of CPU in a first run (issue
23). A file without the note (``--build-id=none``, a non-ELF file) gives
``None``: the caller hashes its content instead.
"""

from __future__ import annotations

import os
import struct

_PT_NOTE = 4
_NT_GNU_BUILD_ID = 3
_HEADER_BYTES = 64  # the largest ELF header (64-bit)
_MAX_NOTES = (
    1 << 16
)  # note segments are a few hundred bytes; bound what a damaged file makes us read
_MAX_PHNUM = 1024


def build_id(path: str) -> str | None:
    """The hex build ID of the ELF file at ``path``, or ``None`` when it has none.

    Raises ``OSError`` when the file cannot be read (as a content hash would).
    """
    with open(path, "rb") as f:
        header = f.read(_HEADER_BYTES)
        if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] not in (1, 2):
            return None
        wide, order = header[4] == 2, "<" if header[5] == 1 else ">"
        if wide:
            phoff, phentsize, phnum = _unpack(order + "32xQ14xHH", header)
        else:
            phoff, phentsize, phnum = _unpack(order + "28xI10xHH", header)
        if phnum == 0 or phnum > _MAX_PHNUM or phentsize < (56 if wide else 32):
            return None
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for index in range(len(table) // phentsize):
            row = table[index * phentsize : (index + 1) * phentsize]
            if wide:
                kind, offset, size = _unpack(order + "I4xQ16xQ", row)
            else:
                kind, offset, size = _unpack(order + "II8xI", row)
            if kind != _PT_NOTE or size > _MAX_NOTES:
                continue
            f.seek(offset)
            found = _in_notes(f.read(size), order)
            if found is not None:
                return found
    return None


def _unpack(fmt: str, data: bytes) -> tuple[int, ...]:
    return struct.unpack_from(fmt, data) if len(data) >= struct.calcsize(fmt) else (0, 0, 0)


def _in_notes(notes: bytes, order: str) -> str | None:
    """The build ID among one note segment's notes (4-byte aligned name and descriptor)."""
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, kind = struct.unpack_from(order + "III", notes, at)
        name_at = at + 12
        desc_at = name_at + _align(namesz)
        end = desc_at + _align(descsz)
        if end > len(notes):
            return None
        if kind == _NT_GNU_BUILD_ID and notes[name_at : name_at + namesz] == b"GNU\0" and descsz:
            return notes[desc_at : desc_at + descsz].hex()
        at = end
    return None


def _align(size: int) -> int:
    return (size + 3) & ~3


def identity(path: str) -> str | None:
    """``build-id:<hex>`` plus the file's size, or ``None`` without a build ID."""
    found = build_id(path)
    return None if found is None else f"build-id:{found} size:{os.stat(path).st_size}"
