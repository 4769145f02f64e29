"""Triton's cache, backed by kernelcache: ``TRITON_CACHE_MANAGER=kernelcache.triton:CacheManager``.

Triton's default ``FileCacheManager`` writes a compile's files one by one
into a directory, so a concurrent writer can mix one compile's cubin with
another's metadata (Triton PR #11319, all-NaN outputs in vLLM #52413); it
never evicts (15 GB+ after autotuning, inode quotas exhausted on Lustre) and
keeps no statistics. Here a Triton *group* (every file of one compile plus
its ``__grp__`` index) is ONE kernelcache entry, published atomically with
all its files, under the size cap, eviction and counters of a
:class:`~kernelcache.Cache`.

How ``triton.compile`` drives a manager (3.9): ``get_group(name)`` first;
on a miss ``put(data, file)`` for every stage, then ``put_group(name,
{file: path})``. The autotuner and the launcher builder (``runtime/build.py``)
instead call ``get_file`` then a lone ``put``. So a manager that was asked
``get_group`` buffers its puts in a private staging directory until
``put_group`` publishes the group; any other put is published at once.

Configuration, read once per process on first use (or :func:`set_cache`):
``KERNELCACHE_TRITON_DIR`` / ``KERNELCACHE_TRITON_MAX_SIZE`` give Triton a
cache directory and cap of its own (default: the shared kernelcache cache);
``KERNELCACHE_TRITON_NAMESPACE`` is mixed into every key, so two setups
sharing one directory can be kept apart.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from kernelcache._extras import missing

try:
    from triton.runtime.cache import CacheManager as _TritonCacheManager
    from triton.runtime.cache import FileCacheManager, RemoteCacheBackend
except ModuleNotFoundError as exc:
    raise missing(exc, package="triton", extra="triton", feature="kernelcache.triton") from exc

from kernelcache.cache import Cache
from kernelcache.entry import Entry, validate_name
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.keys import KeyBuilder
from kernelcache.settings import Settings

__all__ = ["CacheManager", "RemoteBackend", "get_cache", "set_cache", "stats"]

NAMESPACE = "kernelcache.triton"
GROUP_PREFIX = "__grp__"
ENV_DIR = "KERNELCACHE_TRITON_DIR"
ENV_MAX_SIZE = "KERNELCACHE_TRITON_MAX_SIZE"
ENV_NAMESPACE = "KERNELCACHE_TRITON_NAMESPACE"

# Errors that make a stored entry unusable for Triton: a miss, never a crash.
_ENTRY_ERRORS = (StoreError, CorruptEntry, OSError, KeyError, ValueError, TypeError)


class _State:
    """The process-wide cache Triton's managers share (Triton makes one manager per compile)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cache: Cache | None = None
        self.namespace = ""
        self.counters = dict.fromkeys(
            ("group_hits", "group_misses", "groups_published", "file_hits", "file_misses",
             "files_published", "unusable_entries"),
            0,
        )  # fmt: skip

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1


_state = _State()


def set_cache(cache: Cache | None, namespace: str | None = None) -> None:
    """Use ``cache`` (and key ``namespace``) for Triton from now on; ``None`` re-reads the env."""
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"set_cache takes a kernelcache.Cache, not {type(cache).__name__}")
    with _state.lock:
        _state.cache = cache
        _state.namespace = namespace if namespace is not None else os.environ.get(ENV_NAMESPACE, "")


def get_cache() -> Cache:
    """The cache Triton's managers use, created from the environment on first use."""
    with _state.lock:
        if _state.cache is None:
            directory = os.environ.get(ENV_DIR) or None
            max_size = os.environ.get(ENV_MAX_SIZE) or None
            _state.cache = Cache(settings=Settings.load(dir=directory, max_size=max_size))
            _state.namespace = os.environ.get(ENV_NAMESPACE, "")
        return _state.cache


def stats() -> dict[str, Any]:
    """This process's Triton counters plus the cache's per-tier statistics."""
    cache = get_cache()
    with _state.lock:
        counters = dict(_state.counters)
    return {"triton": counters, **cache.stats()}


@functools.lru_cache(maxsize=8)
def _prefix(namespace: str) -> KeyBuilder:
    return KeyBuilder(NAMESPACE).add("namespace", namespace)


def _key(kind: str, triton_key: str, filename: str) -> str:
    """The kernelcache key of one Triton file or group (namespace set by get/set_cache)."""
    # One field instead of four and a cached prefix: this is on every hit.
    return _prefix(_state.namespace).copy().add("file", (kind, triton_key, filename)).hexdigest()


def _as_bytes(data: Any) -> bytes:
    # FileCacheManager writes non-bytes as str(data) in text mode (MLIR modules
    # arrive as objects); UTF-8 is what that gives on every supported platform.
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return str(data).encode("utf-8")


def _publish(cache: Cache, key: str, entry: Entry, names: Iterable[str]) -> dict[str, str]:
    """Store ``entry`` and return a real file for each of ``names``.

    A disk tier that stored the entry makes ``entry.path`` give files inside
    it (capped, evicted, shared); with no persistent tier (read-only,
    disabled, failing) the files come from this process's private temp
    directory, and the memory tier still makes the next compile a hit.
    """
    stored = cache.put(key, entry)
    try:
        return {name: stored.path(name) for name in names}
    except _ENTRY_ERRORS:
        # A name Triton asked for that the group lacks, or a loader-side
        # failure: counted, and the caller's own staged files stay usable.
        _state.count("unusable_entries")
        raise


class CacheManager(_TritonCacheManager):  # type: ignore[misc]
    """Triton's ``CacheManager`` over a kernelcache :class:`~kernelcache.Cache`.

    Concurrency: a group becomes visible to other processes all at once (one
    entry, one atomic publish) or not at all; a compile that fails midway
    publishes nothing. Paths handed out stay valid while the entry is cached.
    Dump and override managers (``TRITON_KERNEL_DUMP``/``_OVERRIDE``) are
    directories for people to read and edit, so they stay Triton's own.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._plain = (
            FileCacheManager(key, override=override, dump=dump) if override or dump else None
        )
        self._cache = get_cache()
        self._grouping = False  # set by get_group: puts wait for put_group
        self._staged: dict[str, str] = {}
        self._stage_dir: str | None = None
        self._cleanup: weakref.finalize[Any, Any] | None = None

    def __repr__(self) -> str:
        return f"kernelcache.triton.CacheManager({self.key!r})"

    # Reads -------------------------------------------------------------
    def get_file(self, filename: str) -> str | None:
        if self._plain is not None:
            return self._plain.get_file(filename)  # type: ignore[no-any-return]
        staged = self._staged.get(filename)
        if staged is not None:
            return staged
        if filename.startswith(GROUP_PREFIX):
            entry = self._cache.get(_key("group", self.key, filename[len(GROUP_PREFIX) :]))
        else:
            entry = self._cache.get(_key("file", self.key, filename))
        if entry is not None:
            try:
                path = entry.path(filename)
            except _ENTRY_ERRORS:
                _state.count("unusable_entries")
            else:
                _state.count("file_hits")
                return path
        _state.count("file_misses")
        return None

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._plain is not None:
            return self._plain.get_group(filename)  # type: ignore[no-any-return]
        self._grouping = True
        entry = self._cache.get(_key("group", self.key, filename))
        if entry is None:
            _state.count("group_misses")
            return None
        try:
            # Names were validated when the entry was read; an unknown one is a KeyError.
            paths = {child: entry.path(child) for child in entry.meta["children"]}
        except _ENTRY_ERRORS:
            _state.count("unusable_entries")
            _state.count("group_misses")
            return None  # Triton recompiles and publishes a good group over it
        _state.count("group_hits")
        return paths

    # Writes ------------------------------------------------------------
    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        if self._plain is not None:
            return self._plain.put(data, filename, binary=binary)  # type: ignore[no-any-return]
        validate_name(filename)
        raw = _as_bytes(data)
        if self._grouping:
            return self._stage(filename, raw)
        entry = Entry({filename: raw}, meta={"triton": "file", "triton_key": self.key})
        path = _publish(self._cache, _key("file", self.key, filename), entry, [filename])
        _state.count("files_published")
        return path[filename]

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        """Publish the group as one entry; ``group`` is rewritten to the published files.

        Triton hands the same dict to ``CompiledKernel`` (and later to load
        hooks), so after this call it names files inside the cache and the
        staging copies can go at once.
        """
        if self._plain is not None:
            return self._plain.put_group(filename, group)  # type: ignore[no-any-return]
        grp_name = validate_name(GROUP_PREFIX + filename)
        artifacts: dict[str, bytes] = {}
        for child, path in group.items():
            validate_name(child)
            with open(path, "rb") as f:
                artifacts[child] = f.read()
        # Names, not paths: relative to the grp file they resolve inside the
        # entry's folder, and no absolute path is ever stored.
        artifacts[grp_name] = json.dumps({"child_paths": {c: c for c in group}}).encode()
        meta = {
            "triton": "group",
            "triton_key": self.key,
            "group": filename,
            "children": list(group),
        }
        entry = Entry(artifacts, meta=meta)
        paths = _publish(self._cache, _key("group", self.key, filename), entry, artifacts)
        for child in group:
            group[child] = paths[child]
        self._discard_staging()
        _state.count("groups_published")
        return paths[grp_name]

    # Staging -----------------------------------------------------------
    def _stage(self, filename: str, raw: bytes) -> str:
        if self._stage_dir is None:
            self._stage_dir = tempfile.mkdtemp(dir=_staging_root())
            # A compile that raises never reaches put_group: its files go when
            # the manager does (Triton drops it when compile() returns).
            self._cleanup = weakref.finalize(self, _remove_own, self._stage_dir, os.getpid())
        # The directory is this manager's alone and nothing else reads it: no
        # temp-and-rename needed (a put that fails midway raises to Triton).
        path = os.path.join(self._stage_dir, filename)
        with open(path, "wb") as f:
            f.write(raw)
        self._staged[filename] = path
        return path

    def _discard_staging(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # runs shutil.rmtree once
        self._stage_dir = self._cleanup = None
        self._staged = {}


_root_lock = threading.Lock()
_root: str | None = None


def _remove_own(path: str, owner: int) -> None:
    # A forked child inherits the parent's staging paths and finalizers; only
    # the process that made a directory may remove it.
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _staging_root() -> str:
    """This process's private staging directory (mode 0700), removed at exit."""
    global _root
    with _root_lock:
        if _root is None or not os.path.isdir(_root):
            _root = tempfile.mkdtemp(prefix="kernelcache-triton-")
            atexit.register(_remove_own, _root, os.getpid())
        return _root


class RemoteBackend(RemoteCacheBackend):  # type: ignore[misc]
    """Triton's ``RemoteCacheBackend`` over the same cache (``TRITON_REMOTE_CACHE_BACKEND``).

    Triton's ``RemoteCacheManager`` stores every file on its own and copies
    hits into ``TRITON_CACHE_DIR`` through a ``FileCacheManager`` (which never
    evicts); prefer :class:`CacheManager`, which needs no local copy. Keys of
    this backend never meet the manager's: the two layouts differ.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._cache = get_cache()

    def get(self, filenames: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for filename in filenames:
            entry = self._cache.get(_key("remote", self.key, filename))
            if entry is None:
                continue
            try:
                found[filename] = entry[validate_name(filename)]
            except (KeyError, ValueError):
                _state.count("unusable_entries")
        return found

    def put(self, filename: str, data: bytes) -> None:
        entry = Entry({validate_name(filename): _as_bytes(data)}, meta={"triton": "remote"})
        self._cache.put(_key("remote", self.key, filename), entry)
