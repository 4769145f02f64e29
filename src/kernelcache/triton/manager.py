"""Triton's ``CacheManager`` over a kernelcache :class:`~kernelcache.Cache`."""

from __future__ import annotations

import json
from typing import Any

from triton.runtime.cache import CacheManager as _TritonCacheManager
from triton.runtime.cache import FileCacheManager

from kernelcache.entry import Entry, validate_name
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.triton.config import Setup, count, current, refresh
from kernelcache.triton.explain import note_compile
from kernelcache.triton.pending import PendingGroup, claim

GROUP_PREFIX = "__grp__"

# Errors that make a stored entry unusable for Triton: a miss, never a crash.
ENTRY_ERRORS = (StoreError, CorruptEntry, OSError, KeyError, ValueError, TypeError)


def as_bytes(data: Any) -> bytes:
    # FileCacheManager writes non-bytes as str(data) in text mode (MLIR modules
    # arrive as objects); UTF-8 is what that gives on every supported platform.
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return str(data).encode("utf-8")


def _group_paths(entry: Entry) -> dict[str, str] | None:
    """A real file for each child of a group entry; ``None`` (counted) if it is unusable."""
    try:
        # Names were validated when the entry was read; an unknown one is a KeyError.
        return {child: entry.path(child) for child in entry.meta["children"]}
    except ENTRY_ERRORS:
        count("unusable_entries")
        return None


class CacheManager(_TritonCacheManager):  # type: ignore[misc]
    """Triton's ``CacheManager`` over a kernelcache :class:`~kernelcache.Cache`.

    Concurrency: a group becomes visible to other processes all at once (one
    entry, one atomic publish) or not at all; a compile that fails midway
    publishes nothing. Of the processes (and machines, with a Redis tier)
    missing the same group at once, one compiles and the others wait for it
    (:mod:`kernelcache.triton.pending`). Paths handed out stay valid while the
    entry is cached. Dump and override managers (``TRITON_KERNEL_DUMP``,
    ``TRITON_KERNEL_OVERRIDE``) are directories for people to read and edit,
    so they stay Triton's own.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._plain = (
            FileCacheManager(key, override=override, dump=dump) if override or dump else None
        )
        # Hits need no check that the directory is still there: their files prove it.
        self._setup: Setup | None = None if self._plain is not None else current(check=False)
        self._grouping = False  # set by get_group: puts wait for put_group
        self._pending: PendingGroup | None = None

    def __repr__(self) -> str:
        return f"kernelcache.triton.CacheManager({self.key!r})"

    @property
    def setup(self) -> Setup:
        """The cache this manager uses: the one in effect when it was made (as Triton's own
        managers fix their directory), or its successor if that directory was removed since."""
        if self._setup is None:
            raise RuntimeError(f"{self!r} is a dump/override manager: it uses Triton's directories")
        return self._setup

    # Reads -------------------------------------------------------------
    def get_file(self, filename: str) -> str | None:
        if self._plain is not None:
            return self._plain.get_file(filename)  # type: ignore[no-any-return]
        staged = self._pending.staged(filename) if self._pending is not None else None
        if staged is not None:
            return staged
        if filename.startswith(GROUP_PREFIX):
            _, entry = self._lookup("group", filename[len(GROUP_PREFIX) :])
        else:
            _, entry = self._lookup("file", filename)
        if entry is not None:
            try:
                path = entry.path(filename)
            except ENTRY_ERRORS:
                count("unusable_entries")
            else:
                count("file_hits")
                return path
        count("file_misses")
        return None

    def get_group(self, filename: str) -> dict[str, str] | None:
        """The group's files, or ``None``: then this manager holds the claim to compile it."""
        if self._plain is not None:
            return self._plain.get_group(filename)  # type: ignore[no-any-return]
        self._grouping = True
        self._end_pending()  # a second get_group: whatever the first one held is over
        key, entry = self._lookup("group", filename)
        setup = self.setup
        if entry is None:
            held = claim(setup.cache, key, setup.timeout)
            if held.entry is None:
                self._pending = PendingGroup(self, setup.cache, held, setup.timeout)
                count("group_misses")
                return None
            # Another thread, process or machine compiled it while we waited.
            count("group_waits")
            entry = held.entry
            if entry.key is None:
                # Handed over by a thread of this process before it stored it:
                # stored here too (the same bytes, an atomic replace), its paths
                # are files inside the cache rather than private copies.
                entry = setup.cache.get(key) or setup.cache.put(key, entry)
        paths = _group_paths(entry)
        if paths is None:
            count("group_misses")
            return None  # Triton recompiles and publishes a good group over it
        count("group_hits")
        return paths

    # Writes ------------------------------------------------------------
    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        if self._plain is not None:
            return self._plain.put(data, filename, binary=binary)  # type: ignore[no-any-return]
        validate_name(filename)
        raw = as_bytes(data)
        if self._grouping:
            setup = self.setup
            if self._pending is None:  # get_group hit, and Triton compiles anyway (always_compile)
                self._pending = PendingGroup(self, setup.cache, None, setup.timeout)
            return self._pending.stage(filename, raw)
        setup = self._setup = refresh(self.setup)
        entry = Entry({filename: raw}, meta={"triton": "file", "triton_key": self.key})
        stored = setup.cache.put(setup.key("file", self.key, filename), entry)
        path = self._path(stored, filename)
        count("files_published")
        return path

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
        setup = self.setup
        key = setup.key("group", self.key, filename)
        note_compile(key, self.key)  # what Triton's hash was made of, for `kernelcache explain`
        held, self._pending = self._pending, None
        stored = held.publish(key, entry) if held is not None else setup.cache.put(key, entry)
        paths = {name: self._path(stored, name) for name in artifacts}
        for child in group:
            group[child] = paths[child]
        count("groups_published")
        return paths[grp_name]

    def _lookup(self, kind: str, name: str) -> tuple[str, Entry | None]:
        """The key of a group or file and its entry; a miss first makes sure that the
        directory is still the one the cache opened (``rm -rf`` of it: a cold cache there)."""
        setup = self.setup
        key = setup.key(kind, self.key, name)
        entry = setup.cache.get(key)
        if entry is None:
            fresh = refresh(setup)
            if fresh is not setup:
                self._setup = fresh
                key = fresh.key(kind, self.key, name)
                entry = fresh.cache.get(key)
        return key, entry

    @staticmethod
    def _path(stored: Entry, name: str) -> str:
        """A real file for ``name`` of an entry just stored (inside the disk tier when there is one;
        with no persistent tier, a private copy, and the memory tier still makes the next compile
        a hit)."""
        try:
            return stored.path(name)
        except ENTRY_ERRORS:
            count("unusable_entries")
            raise

    def _end_pending(self) -> None:
        held, self._pending = self._pending, None
        if held is not None:
            held.release()
