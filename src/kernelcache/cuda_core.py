"""A :class:`cuda.core.utils.ProgramCacheResource` backed by a kernelcache :class:`Cache`.

>>> from cuda.core import Program, ProgramOptions
>>> from kernelcache.cuda_core import ProgramCache
>>> prog = Program(src, "c++", ProgramOptions(arch="sm_90"))
>>> obj = prog.compile("cubin", cache=ProgramCache())   # a hit on the second run

cuda.core derives the key (``make_program_cache_key``) and hands us bytes-like
keys and :class:`~cuda.core.ObjectCode` values; each value is stored as an
:class:`~kernelcache.Entry` holding the code's bytes plus its code type, name
and symbol mapping as JSON metadata (never pickle: a shared cache that
unpickles is a code-execution hole). ``__getitem__`` returns the bytes, as the
ABC requires; :meth:`ProgramCache.get_object_code` rebuilds the full
``ObjectCode``, symbol mapping included.

Users get kernelcache's tiers, size caps, integrity checks, statistics and,
with ``KERNELCACHE_REMOTE``, the team tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelcache._extras import missing

try:
    from cuda.core.utils import ProgramCacheResource
except ModuleNotFoundError as exc:
    raise missing(exc, package="cuda.core", extra="nvrtc", feature="kernelcache.cuda_core") from exc

from kernelcache.entry import Entry
from kernelcache.errors import StoreError
from kernelcache.keys import KeyBuilder

if TYPE_CHECKING:
    from cuda.core import ObjectCode

    from kernelcache.cache import Cache
    from kernelcache.stores.base import Store

#: Every key this resource writes starts with this, so ``len`` and ``clear``
#: touch only cuda.core's entries in a cache shared with other integrations.
KEY_PREFIX = "cudacore-"
_ARTIFACT = "code"
_LOADERS = {
    "cubin": "from_cubin",
    "ptx": "from_ptx",
    "ltoir": "from_ltoir",
    "fatbin": "from_fatbin",
    "object": "from_object",
    "library": "from_library",
}


def cache_key(key: bytes | str) -> str:
    """The kernelcache key for a cuda.core key (``"k"`` and ``b"k"`` are the same key)."""
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raise TypeError(f"cache keys must be bytes or str, got {type(key).__name__}")
    return KEY_PREFIX + KeyBuilder("kernelcache.cuda_core").add("key", raw).hexdigest()


def _to_entry(value: object) -> Entry:
    from cuda.core import ObjectCode

    if isinstance(value, (bytes, bytearray, memoryview)):
        return Entry({_ARTIFACT: bytes(value)}, {"code_type": None})
    if not isinstance(value, ObjectCode):
        raise TypeError(
            f"cache values must be bytes-like or ObjectCode, got {type(value).__name__}"
        )
    code = value.code
    if isinstance(code, str):
        # A path-backed ObjectCode: store the content, never the path, which
        # may be gone or different by the time the entry is read.
        try:
            code = Path(code).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"cannot store path-backed ObjectCode in cache: {value.code} no longer exists"
            ) from None
    mapping = value.symbol_mapping or {}
    meta: dict[str, Any] = {
        "code_type": value.code_type,
        "name": value.name,
        "symbol_mapping": {str(k): _text(v) for k, v in mapping.items()},
    }
    return Entry({_ARTIFACT: bytes(code)}, meta)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ProgramCache(ProgramCacheResource):  # type: ignore[misc]
    """cuda.core's program-cache interface over kernelcache tiers.

    Thread- and process-safe as the underlying tiers are (all built-in ones
    are): a reader sees a whole entry or none. ``cache=None`` uses the shared
    default ``Cache()`` (``KERNELCACHE_DIR`` and friends respected).
    """

    def __init__(self, cache: Cache | None = None) -> None:
        if cache is None:
            from kernelcache._defaults import default_cache

            cache = default_cache()
        self.cache = cache

    def __getitem__(self, key: bytes | str) -> bytes:
        entry = self.cache.get(cache_key(key))
        if entry is None:
            raise KeyError(key)
        return entry[_ARTIFACT]

    def __setitem__(
        self, key: bytes | str, value: bytes | bytearray | memoryview | ObjectCode
    ) -> None:
        self.cache.put(cache_key(key), _to_entry(value))

    def __delitem__(self, key: bytes | str) -> None:
        if not self.cache.delete(cache_key(key)):
            raise KeyError(key)

    def __len__(self) -> int:
        """Entries of this resource in the fullest tier (tiers overlap, so they are not summed)."""
        return max((len(self._own_keys(tier)) for tier in self.cache.tiers), default=0)

    def clear(self) -> None:
        for tier in self.cache.tiers:
            if tier.read_only:
                continue
            for key in self._own_keys(tier):
                try:
                    tier.delete(key)
                except StoreError:
                    continue  # counted by the tier; clear what can be cleared

    @staticmethod
    def _own_keys(tier: Store) -> list[str]:
        try:
            listing = tier.keys()
            return [key for key in listing if key.startswith(KEY_PREFIX)]
        except StoreError:
            return []  # an unavailable tier holds nothing we can see

    def get_object_code(self, key: bytes | str) -> ObjectCode | None:
        """The stored code as an ``ObjectCode`` (name and symbol mapping kept), or ``None``."""
        from cuda.core import ObjectCode

        entry = self.cache.get(cache_key(key))
        if entry is None:
            return None
        meta = entry.meta
        code_type = meta.get("code_type")
        if code_type not in _LOADERS:
            raise ValueError(
                f"entry for {key!r} was stored from raw bytes with no code type; "
                "read it with cache[key] and build the ObjectCode yourself"
            )
        loader = getattr(ObjectCode, _LOADERS[code_type])
        return loader(
            entry[_ARTIFACT],
            name=meta.get("name") or "",
            symbol_mapping=meta.get("symbol_mapping") or None,
        )

    def close(self) -> None:
        """The cache may be shared (the default one is), so closing leaves it open."""
