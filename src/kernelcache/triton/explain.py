"""What Triton's own key was made of, noted with the group entry it names (issue 38).

A Triton entry's key holds Triton's hash of its compile key, so by itself it
can only say "that hash changed". ``triton.compile`` (3.9) makes that key as
``get_cache_key(src, backend, options, env_vars)``: Triton's version and
compiler hashes, the source's hash (the kernel and what it calls, its
signature, constants and attributes), the backend's hash (``ptxas`` version
and architecture), the options' hash and the environment variables Triton
keys. When a group is published, the compile is still running below the
manager: :func:`note_compile` reads those parts from its frame, checks that
they hash to the key the manager was given, and notes them
(:func:`kernelcache.explain.note_fields`), so ``kernelcache explain
--last-miss triton`` says "`options.num_warps`: 4 → 8" or "the source
changed". A miss path only (``put_group``); a hit never comes here. Another
Triton whose ``compile`` keeps other names notes nothing: its entries keep
the opaque hash.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import inspect
from types import FrameType
from typing import Any

from kernelcache.explain import note_fields

__all__ = ["compile_parts", "note_compile"]

_COMPILE = ("triton.compiler.compiler", "compile")
_DEPTH = 16


def note_compile(key: str, triton_hash: str) -> bool:
    """Note the parts of the running ``triton.compile`` whose hash is ``triton_hash`` with
    ``key`` (the group entry's key); whether they were found."""
    here = inspect.currentframe()
    parts = compile_parts(triton_hash, None if here is None else here.f_back)
    del here
    if parts is None:
        return False
    note_fields(key, parts, covers=("file",))
    return True


def compile_parts(triton_hash: str, frame: FrameType | None) -> dict[str, Any] | None:
    """The parts of Triton's key, from the ``triton.compile`` frame at or above ``frame``
    whose key hashes to ``triton_hash``; ``None`` if there is none."""
    found = None
    for _ in range(_DEPTH):
        if frame is None:
            break
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _COMPILE:
            found = frame.f_locals
            break
        frame = frame.f_back
    del frame
    if found is None:
        return None
    key = found.get("key")
    if not isinstance(key, str) or triton_hash not in _names(hashlib.sha256(key.encode()).digest()):
        return None  # not the compile this manager serves, or a Triton that names it otherwise
    try:
        src, backend, options = found["src"], found["backend"], found["options"]
        env = found["env_vars"]
        parts = {
            "kernel": str(src.name),
            **_source(src),
            "options": _plain(dict(vars(options))),
            "target": _plain(dataclasses.asdict(backend.target)),
            "backend": str(backend.hash()),
            "triton": _triton(),
            "env": _plain(dict(env or {})),
        }
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    stages = found.get("inspect_stages_key")
    if stages is not None:
        parts["inspect_stages"] = str(stages)
    return parts


def _names(digest: bytes) -> tuple[str, str]:
    """The names a manager is given for a key's digest: base32 (``get_cache_manager``), hex."""
    return base64.b32encode(digest).decode().rstrip("="), digest.hex()


def _source(src: Any) -> dict[str, Any]:
    """The source's part of the key: for a ``@triton.jit`` function its cache key (its text
    and what it calls), signature, constants and attributes; for an IR file its hash."""
    fn = getattr(src, "fn", None)
    if fn is None:
        return {"source": str(src.hash()).encode()}
    names = list(getattr(fn, "arg_names", []))
    constants = {}
    for index, value in sorted(src.constants.items()):
        name = names[index[0]] if len(index) == 1 and index[0] < len(names) else str(index)
        constants[name] = value.cache_key if hasattr(value, "cache_key") else str(value)
    return {
        # bytes: kept as a digest, said "the source changed"
        "source": str(fn.cache_key).encode(),
        "signature": _plain(dict(src.signature)),
        "constants": constants,
        "attrs": str(src.attrs),
    }


def _triton() -> str:
    """Triton's version, and a digest of its compiler and libraries (``triton_key()``)."""
    import triton
    from triton.runtime import cache

    build = hashlib.sha256(cache.triton_key().encode()).hexdigest()[:12]
    return f"{triton.__version__} (build {build})"


def _plain(value: Any) -> Any:
    """``value`` as a key field takes it: containers as lists and str-keyed dicts, other
    objects as their text (which is what Triton's key hashes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
