"""Content-addressed cache keys.

A key is the SHA-256 of a canonical encoding of labelled fields. Every value is
written as ``tag + length + payload`` so that no two different inputs share an
encoding: ``1``, ``"1"``, ``True``, ``b"1"`` and ``1.0`` differ by tag, and
``("a", "b")`` differs from ``("ab",)`` by the lengths. Concatenating strings
with separators (Triton's ``f"{a}-{b}"``) or hashing ``repr()`` (TileLang) both
produce collisions or unstable keys; this module does neither.

Pure functions only: no I/O, so keys can be tested without storage.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Mapping
from hashlib import sha256
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hashlib import _Hash

__all__ = [
    "MAX_DEPTH",
    "SCHEMA_VERSION",
    "KeyBuilder",
    "built",
    "encode",
    "family",
    "family_of",
    "file_sha256",
    "make_key",
    "sha256",
]

#: Bumped whenever the encoding changes, so old and new keys never coincide.
#: 2: ints are encoded as two's-complement bytes, not decimal text (issue 19).
SCHEMA_VERSION = 2
#: Deeper nesting raises TypeError: a key is a flat record of settings, and a
#: recursion this deep (or a list holding itself) is a bug in the caller.
MAX_DEPTH = 100

_LEN = struct.Struct(">Q")
_FLOAT = struct.Struct(">d")


def _frame(tag: bytes, payload: bytes) -> bytes:
    return tag + _LEN.pack(len(payload)) + payload


def encode(value: Any) -> bytes:
    """Return the canonical, type-tagged encoding of ``value``.

    Supported: None, bool, int (any size), float, str, bytes-like, list/tuple
    (same tag: option lists are often passed either way), dict
    (order-independent) and any nesting of these up to :data:`MAX_DEPTH`
    levels. Anything else, or deeper nesting, raises :class:`TypeError`: a
    silent ``repr()`` would put addresses or unstable text into keys.
    """
    return _encode(value, 0)


def _int_bytes(value: int) -> bytes:
    # Bytes, not decimal text: str(int) refuses ints over 4300 digits (issue 19),
    # and bytes are shorter. Two's complement keeps -1 and 255 apart.
    return value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True)


def _encode(value: Any, depth: int) -> bytes:
    # bool before int: bool is a subclass of int but must not collide with 1/0.
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return _frame(b"i", _int_bytes(int(value)))
    if isinstance(value, float):
        # One NaN, and -0.0 kept distinct from 0.0 (they can change codegen).
        payload = b"nan" if math.isnan(value) else _FLOAT.pack(value)
        return _frame(b"f", payload)
    if isinstance(value, str):
        return _frame(b"s", value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _frame(b"b", bytes(value))
    if isinstance(value, (list, tuple, Mapping)):
        if depth >= MAX_DEPTH:
            raise TypeError(
                f"cannot use a value nested more than {MAX_DEPTH} levels deep in a cache key "
                "(or a list or dict that contains itself)"
            )
        if isinstance(value, Mapping):
            items = sorted(_encode(k, depth + 1) + _encode(v, depth + 1) for k, v in value.items())
            return _frame(b"d", b"".join(items))
        return _frame(b"l", b"".join(_encode(item, depth + 1) for item in value))
    raise TypeError(
        f"cannot use a value of type {type(value).__module__}.{type(value).__qualname__} "
        "in a cache key; convert it to str, bytes, int, float, bool, None, list or dict "
        "(or fingerprint it with kernelcache.fingerprint)"
    )


#: Keys this process built lately (``hexdigest()``), with their namespace and
#: labelled fields as encoded, so that an entry stored under one, or a miss of
#: one, can say what it was made of (:mod:`kernelcache.explain`). Bounded (the
#: oldest goes first); the encodings are only referenced, never copied.
BUILT_MAX = 512
#: ... and at most about this many bytes of encodings: NVRTC keys hold sources and header
#: contents, and a JIT process that builds many variants must not keep hundreds of MB.
BUILT_MAX_BYTES = 64 << 20
_BUILT: dict[str, tuple[str, tuple[tuple[str, bytes], ...]]] = {}
_built_bytes = [0]  # of the encodings _BUILT holds (approximate under races: a bound)
#: Keys this process missed lately (``Cache.get``), newest last.
MISSED: deque[str] = deque(maxlen=32)


def _size(fields: tuple[tuple[str, bytes], ...]) -> int:
    return sum(len(encoded) for _, encoded in fields)


def built(key: str) -> tuple[str, tuple[tuple[str, bytes], ...]] | None:
    """``(namespace, ((label, encoded value), ...))`` of a key this process built lately."""
    return _BUILT.get(key)


def family(namespace: str) -> str:
    """The integration family of a key namespace (``kernelcache.nvcc.direct`` -> ``nvcc``):
    what statistics and ``kernelcache explain --last-miss`` group keys by."""
    parts = namespace.replace("/", ".").split(".")  # JAX's is "jax/1"
    name = parts[1] if parts[0] == "kernelcache" and len(parts) > 1 else parts[0]
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name.lower())
    return cleaned[:40] or "other"


def family_of(key: str) -> str:
    """:func:`family` of a key this process built lately; ``other`` for any other key."""
    found = _BUILT.get(key)
    return "other" if found is None else family(found[0])


class KeyBuilder:
    """Build a key from labelled fields.

    ``KeyBuilder("my-dsl").add("source", src).add("arch", "sm_90").hexdigest()``

    The namespace and schema version are hashed first, so two tools that hash
    the same fields never share keys. The fields are remembered as well (the
    encodings already made for the hash, not copies): a key built here can
    explain itself (:func:`built`, :mod:`kernelcache.explain`).
    """

    __slots__ = ("_fields", "_hash", "namespace")

    def __init__(
        self,
        namespace: str,
        *,
        _state: _Hash | None = None,
        _fields: list[tuple[str, bytes]] | None = None,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise TypeError("KeyBuilder needs a non-empty str namespace")
        self.namespace = namespace
        if _state is not None:  # copy(): the fields so far, already hashed
            self._hash = _state
            self._fields = _fields if _fields is not None else []
            return
        self._fields = []
        self._hash = sha256()
        self._hash.update(encode(("kernelcache-key", SCHEMA_VERSION, namespace)))

    def add(self, label: str, value: Any) -> KeyBuilder:
        """Mix in one labelled field; returns ``self`` for chaining."""
        if not isinstance(label, str):
            raise TypeError(f"key labels must be str, not {type(label).__name__}")
        encoded = encode(value)
        self._hash.update(encode(label) + encoded)
        self._fields.append((label, encoded))
        return self

    def copy(self) -> KeyBuilder:
        """An independent builder holding the fields added so far."""
        return KeyBuilder(self.namespace, _state=self._hash.copy(), _fields=self._fields[:])

    def digest(self) -> bytes:
        """The 32-byte key; the builder can still be extended afterwards."""
        return self._hash.copy().digest()

    def hexdigest(self) -> str:
        """The key as 64 lowercase hex characters (what stores take)."""
        key = self._hash.copy().hexdigest()
        fields = tuple(self._fields)
        old = _BUILT.get(key)
        _BUILT[key] = (self.namespace, fields)
        _built_bytes[0] += _size(fields) - (_size(old[1]) if old is not None else 0)
        while len(_BUILT) > BUILT_MAX or (_built_bytes[0] > BUILT_MAX_BYTES and len(_BUILT) > 1):
            # The oldest; another thread changing the table meanwhile raises RuntimeError.
            try:
                gone = _BUILT.pop(next(iter(_BUILT)))
            except (RuntimeError, StopIteration, KeyError):
                break
            _built_bytes[0] -= _size(gone[1])
        return key


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB chunks."""
    digest = sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def make_key(namespace: str, **fields: Any) -> str:
    """Shorthand: the hex key of ``fields`` (labels sorted, so order is irrelevant)."""
    builder = KeyBuilder(namespace)
    for label in sorted(fields):
        builder.add(label, fields[label])
    return builder.hexdigest()
