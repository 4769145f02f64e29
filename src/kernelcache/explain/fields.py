"""A key's fields, as an entry keeps them: label, short digest, and the value when small.

:class:`~kernelcache.keys.KeyBuilder` remembers the fields of the keys this
process built (:func:`kernelcache.keys.built`). :func:`summary` turns them
into the small JSON record an entry carries in its metadata
(:data:`META_FIELD`), flattened so that each thing that can change on its
own is one field:

- a field whose value is another key this process built (the launcher's
  command key inside its direct key) is replaced by that key's fields,
  ``command.nvcc``, ``command.args``, ...;
- a dict becomes one field per item (``env.NVCC_APPEND_FLAGS``);
- a list of rows naming files (``[[root, path, digest], ...]``) becomes one
  field per file (``included[common.cuh]``);
- files an integration read to build its key (:func:`note_inputs`, the
  launcher's headers) become ``input[common.cuh]`` fields.

A value is kept only when small and not secret (a flag list, a version, an
architecture); every field keeps a 12-hex digest of its encoding, so two
records can always be compared field by field. Nothing here changes a key.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Mapping
from hashlib import sha256
from typing import Any

from kernelcache.entry import KEY_RECORD
from kernelcache.keys import built, encode

__all__ = ["META_FIELD", "Field", "decode", "note_fields", "note_inputs", "summary"]

#: The entry metadata field that holds its key's fields.
META_FIELD = KEY_RECORD
#: A value whose encoding is longer than this is kept as a digest only.
MAX_VALUE_BYTES = 640
#: Fields whose label says they hold a secret never keep their value.
_SECRET = re.compile(r"secret|token|password|passwd|credential|auth", re.IGNORECASE)
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_MAX_ITEMS = 256
_MAX_DEPTH = 4
_INPUTS_MAX = 512
_INPUTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {}
_NOTES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {}

#: One field: ``[label, digest]``, or ``[label, digest, value]`` when the value is kept
#: (a list: it is stored as JSON).
Field = list[Any]


def note_inputs(key: str, files: Mapping[str, str], covers: tuple[str, ...] = ()) -> None:
    """Remember the files (name -> content digest) that ``key``'s entry was built from.

    For a key that holds what the files produced rather than the files
    themselves (the launcher's preprocessed key): the entry then says which
    file changed. ``covers``: the key's fields these files determine, left out
    of its record (they differ exactly when a file does).
    """
    _INPUTS[key] = ({str(k): str(v) for k, v in files.items()}, covers)
    if len(_INPUTS) > _INPUTS_MAX:
        _INPUTS.pop(next(iter(_INPUTS)), None)


def note_fields(key: str, fields: Mapping[str, Any], covers: tuple[str, ...] = ()) -> None:
    """Remember what an opaque field of ``key`` was made of, to explain it field by field.

    For an integration whose key holds another tool's hash (Triton's, torch's):
    ``note_fields(key, {"source": ..., "options": {...}, "env": {...}}, covers=("file",))``
    records those parts (values as a key takes them) with the entry, in place of
    the fields named in ``covers``. The key itself is not changed.
    """
    encoded = {str(label): encode(value) for label, value in fields.items()}  # TypeError early
    _NOTES[key] = (encoded, covers)
    if len(_NOTES) > _INPUTS_MAX:
        _NOTES.pop(next(iter(_NOTES)), None)


def summary(key: str) -> dict[str, Any] | None:
    """``{"ns": namespace, "fields": [Field, ...]}`` of a key this process built, or ``None``."""
    found = built(key)
    if found is None:
        return None
    namespace, raw = found
    inputs, covers = _INPUTS.get(key, ({}, ()))
    notes, noted_covers = _NOTES.get(key, ({}, ()))
    fields: list[Field] = []
    for label, encoded in raw:
        if label not in covers and label not in noted_covers:
            _flatten(fields, label, encoded, 0)
    for label, encoded in notes.items():
        _flatten(fields, label, encoded, 0)
    fields.extend(_grouped(inputs))
    return {"ns": namespace, "fields": fields}


def _grouped(inputs: dict[str, str]) -> list[Field]:
    """A field per input file; those outside the working directory (system and toolkit
    headers: ~190 for one CUDA source) one per folder, to keep records small, with
    how many files it holds as its value."""
    here = os.getcwd() + os.sep
    folders: dict[str, list[str]] = {}
    out: list[Field] = []
    for name, digest in sorted(inputs.items()):
        if os.path.isabs(name) and not name.startswith(here):
            folders.setdefault(os.path.dirname(name) + "/*", []).append(name + "\0" + digest)
        else:
            out.append([f"input[{name}]", _short(digest.encode())])
    for folder, rows in folders.items():
        out.append([f"input[{folder}]", _short("\n".join(rows).encode()), len(rows)])
    return out


def _short(encoded: bytes) -> str:
    return sha256(encoded).hexdigest()[:12]


def _flatten(out: list[Field], label: str, encoded: bytes, depth: int) -> None:
    value = decode(encoded)
    if depth < _MAX_DEPTH:
        if isinstance(value, str) and _HEX_KEY.fullmatch(value):
            inner = built(value)
            if inner is not None:
                for sub, sub_encoded in inner[1]:
                    _flatten(out, f"{label}.{sub}", sub_encoded, depth + 1)
                return
        if (
            isinstance(value, dict)
            and 0 < len(value) <= _MAX_ITEMS
            and all(isinstance(k, str) for k in value)
        ):
            for name in sorted(value):
                _flatten(out, f"{label}.{name}", encode(value[name]), depth + 1)
            return
        rows = _rows(value)
        if rows is not None:
            for name, rest in rows:
                out.append([f"{label}[{name}]", _short(encode(rest))])
            return
    field: Field = [label, _short(encoded)]
    if isinstance(value, str) and len(encoded) > MAX_VALUE_BYTES and "\n" in value:
        value = _trimmed(value) or value  # a tool's identity: its version lines, not its hashes
    if _keeps(label, value, encode(value)):
        field.append(value)
    out.append(field)


def _trimmed(text: str) -> str:
    """The short lines of a long text (its digests and long lines left out), within the
    size a kept value may have."""
    kept: list[str] = []
    size = 0
    for line in text.splitlines():
        if len(line) > 100 or "sha256:" in line or _HEX_RUN.search(line):
            continue
        size += len(line) + 1
        if size > MAX_VALUE_BYTES - 32:
            break
        kept.append(line)
    return "\n".join(kept)


_HEX_RUN = re.compile(r"[0-9a-f]{32}")


def _rows(value: object) -> list[tuple[str, Any]] | None:
    """``[(name, rest)]`` of a list of rows naming files by their leading strings, or ``None``."""
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_ITEMS:
        return None
    rows = []
    for row in value:
        if not isinstance(row, list) or len(row) < 2:
            return None
        names = [part for part in row[:-1] if isinstance(part, str)]
        if len(names) != len(row) - 1 or not _is_digest(row[-1]):
            return None
        rows.append(("/".join(names), row[-1]))
    if len({name for name, _ in rows}) != len(rows):
        return None
    return rows


def _is_digest(value: object) -> bool:
    """A content digest: bytes, or a hex string of at least 16 characters."""
    if isinstance(value, bytes):
        return True
    return isinstance(value, str) and len(value) >= 16 and _HEX.fullmatch(value) is not None


_HEX = re.compile(r"[0-9a-f]+")


def _keeps(label: str, value: object, encoded: bytes) -> bool:
    """Whether a field keeps its value: small, not secret, plain JSON (no bytes, no NaN)."""
    if len(encoded) > MAX_VALUE_BYTES or _SECRET.search(label):
        return False
    items = value if isinstance(value, list) else [value]
    flat = [v for item in items for v in (item if isinstance(item, list) else [item])]
    if any(isinstance(v, str) and _SECRET.search(v) for v in flat):
        return False  # -DAPI_TOKEN=...: the record goes to the team tier with the entry
    return all(
        v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and v == v)
        for v in flat
    )


_LEN = struct.Struct(">Q")
_FLOAT = struct.Struct(">d")


def decode(encoded: bytes) -> Any:
    """The value :func:`kernelcache.keys.encode` encoded (tuples come back as lists).

    Dict keys that are not str come back as str (their JSON form).
    """
    value, end = _decode(encoded, 0)
    if end != len(encoded):
        raise ValueError("trailing bytes after an encoded value")
    return value


def _decode(data: bytes, at: int) -> tuple[Any, int]:
    tag = data[at : at + 1]
    if tag == b"N":
        return None, at + 1
    if tag in (b"T", b"F"):
        return tag == b"T", at + 1
    if tag not in (b"i", b"f", b"s", b"b", b"l", b"d"):
        raise ValueError(f"unknown tag {tag!r} in an encoded value")
    try:
        (length,) = _LEN.unpack_from(data, at + 1)
    except struct.error as exc:
        raise ValueError(f"truncated encoded value: {exc}") from None
    start = at + 1 + _LEN.size
    end = start + length
    if end > len(data):
        raise ValueError("truncated encoded value")
    payload = data[start:end]
    if tag == b"i":
        return int.from_bytes(payload, "big", signed=True), end
    if tag == b"f":
        return (float("nan") if payload == b"nan" else _FLOAT.unpack(payload)[0]), end
    if tag == b"s":
        return payload.decode("utf-8", "surrogatepass"), end
    if tag == b"b":
        return payload, end
    if tag == b"l":
        items = []
        pos = start
        while pos < end:
            item, pos = _decode(data, pos)
            items.append(item)
        return items, end
    out: dict[Any, Any] = {}  # b"d"
    pos = start
    while pos < end:
        name, pos = _decode(data, pos)
        item, pos = _decode(data, pos)
        out[name if isinstance(name, str) else repr(name)] = item
    return out, end
