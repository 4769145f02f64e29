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

``Program.compile(cache=...)`` refuses options that pull in header files
(``include_path``, ``pre_include``, a ``name`` with a directory): cuda.core
cannot see their content, so the caller must pass it as ``extra_digest`` to
``make_program_cache_key``. :func:`header_digest` is that digest, found as
:mod:`kernelcache.nvrtc` finds headers and just as cheap on a warm call::

    key = make_program_cache_key(code=src, code_type="c++", options=opts,
                                 target_type="cubin", extra_digest=header_digest(src, opts))
    code = ProgramCache().get(key)   # None on a miss: compile, then cache[key] = obj

Versions: tested on cuda.core :data:`TESTED` (every 1.x release has
``ProgramCacheResource``; the oldest and newest are cells of the version
matrix); :func:`support` says what kernelcache makes of the installed one.
Keys are cuda.core's own (``make_program_cache_key`` holds its version).
"""

from __future__ import annotations

import os
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
from kernelcache.nvrtc import includes
from kernelcache.nvrtc.key import KeyMemo, refusal
from kernelcache.versions import Range, Seam, Support, decide

if TYPE_CHECKING:
    from cuda.core import ObjectCode, ProgramOptions

    from kernelcache.cache import Cache
    from kernelcache.stores.base import Store

#: cuda.core releases this resource was tested on.
TESTED = Range("1.0", "1.2")
#: What it needs of the installed cuda.core.
SEAMS: tuple[Seam, ...] = (
    "cuda.core.utils:ProgramCacheResource",
    "cuda.core:ObjectCode.from_cubin",
    "cuda.core:ObjectCode.from_ptx",
)


def support(version: str | None = None) -> Support:
    """What kernelcache makes of ``version`` of cuda.core (default: the installed one)."""
    from importlib.metadata import version as installed

    return decide("cuda.core", version or installed("cuda-core"), TESTED, SEAMS)


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


# cache_key is a pure function asked on every hit with the same few keys:
# remembered (~4 us a call otherwise). Plain bytes and str only: a subclass
# could make unequal keys compare equal. Bounded; cleared when full.
_KEYS: dict[bytes | str, str] = {}
_KEYS_MAX = 4096


def cache_key(key: bytes | str) -> str:
    """The kernelcache key for a cuda.core key (``"k"`` and ``b"k"`` are the same key)."""
    plain = type(key) is bytes or type(key) is str
    if plain:
        known = _KEYS.get(key)
        if known is not None:
            return known
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raise TypeError(f"cache keys must be bytes or str, got {type(key).__name__}")
    derived = KEY_PREFIX + KeyBuilder("kernelcache.cuda_core").add("key", raw).hexdigest()
    if plain:
        if len(_KEYS) >= _KEYS_MAX:
            _KEYS.clear()
        _KEYS[key] = derived
    return derived


#: Options whose files header_digest cannot fingerprint. Value: why.
_UNKEYABLE = {
    "pch": "reads and writes precompiled headers outside the key",
    "use_pch": "reads a precompiled header whose content is not part of the key",
    "pch_dir": "reads and writes precompiled headers in a directory outside the key",
    "create_pch": "writes a precompiled header file, which a cache hit would not do",
}
#: This process's header digests, each valid while the files it read keep their stat
#: signatures (the mechanism of kernelcache.nvrtc's keys; tests replace it).
digests = KeyMemo()


def header_digest(code: str | bytes, options: ProgramOptions) -> bytes:
    """``extra_digest`` for ``make_program_cache_key``: the content of every header ``code``
    reaches, transitively, through ``options.include_path``, ``options.pre_include`` and the
    directory of ``options.name`` (NVRTC's search rules, as :mod:`kernelcache.nvrtc.includes`
    follows them).

    Files are named by their place in the search (not their absolute path),
    so a copy of a project gets the same digest; with ``debug`` or
    ``lineinfo`` the paths are part of it too (they end up in the binary).
    A warm call costs a ``stat`` per header read: a header whose stat
    signature is unchanged is not read again, one younger than the
    timestamp granularity is never trusted. Raises ``ValueError`` for
    options or includes that cannot be fingerprinted (PCH, ``#include MACRO``,
    anything :mod:`kernelcache.directives` cannot read exactly) and for a
    source or header naming a time macro unless
    ``KERNELCACHE_SLOPPINESS=time_macros`` (the rule of every integration).
    """
    for field, why in _UNKEYABLE.items():
        if getattr(options, field, None):
            raise ValueError(f"ProgramOptions.{field} cannot be fingerprinted: it {why}")
    name = options.name or ""
    dirs = _strings(options.include_path)
    pre = _strings(options.pre_include)
    own_dir = not options.no_source_include
    paths = bool(options.debug or options.lineinfo)
    args: tuple[Any, ...] | None = None
    if {type(code), type(name), *map(type, dirs), *map(type, pre)} <= {str, bytes}:
        args = (os.getcwd(), code, name, tuple(dirs), tuple(pre), own_dir, paths)
        known = digests.lookup(args)
        if known is not None:
            return bytes.fromhex(known)
    found = includes.scan(
        code.encode() if isinstance(code, str) else bytes(code),
        source_dir=os.path.dirname(name) if own_dir else None,
        include_dirs=dirs,
        headers={},
        pre_includes=pre,
        path_sensitive=paths,
    )
    refused = refusal(found)
    if refused is not None:
        raise ValueError(f"this program cannot be cached: {refused}")
    builder = KeyBuilder("kernelcache.cuda_core.headers")
    builder.add("included", [list(row) for row in found.rows]).add("pre_includes", pre)
    builder.add("paths", found.paths + ([os.getcwd()] if paths else []))
    digest = builder.hexdigest()
    if args is not None:
        digests.remember(args, digest, found)
    return bytes.fromhex(digest)


def _strings(value: object) -> list[str]:
    """A ``str``-or-sequence option of ProgramOptions as a list."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value]  # type: ignore[attr-defined]


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
