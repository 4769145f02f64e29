"""Triton's ``RemoteCacheBackend`` over the same cache (``TRITON_REMOTE_CACHE_BACKEND``)."""

from __future__ import annotations

from triton.runtime.cache import RemoteCacheBackend

from kernelcache.entry import Entry, validate_name
from kernelcache.triton.config import count, current
from kernelcache.triton.manager import as_bytes


class RemoteBackend(RemoteCacheBackend):  # type: ignore[misc]
    """Triton's ``RemoteCacheBackend`` over the same cache (``TRITON_REMOTE_CACHE_BACKEND``).

    Triton's ``RemoteCacheManager`` stores every file on its own and copies
    hits into ``TRITON_CACHE_DIR`` through a ``FileCacheManager`` (which never
    evicts); prefer :class:`~kernelcache.triton.CacheManager`, which needs no
    local copy and compiles each kernel once across processes. Keys of this
    backend never meet the manager's: the two layouts differ.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._setup = current()

    def get(self, filenames: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for filename in filenames:
            entry = self._setup.cache.get(self._setup.key("remote", self.key, filename))
            if entry is None:
                continue
            try:
                found[filename] = entry[validate_name(filename)]
            except (KeyError, ValueError):
                count("unusable_entries")
        return found

    def put(self, filename: str, data: bytes) -> None:
        entry = Entry({validate_name(filename): as_bytes(data)}, meta={"triton": "remote"})
        self._setup.cache.put(self._setup.key("remote", self.key, filename), entry)
