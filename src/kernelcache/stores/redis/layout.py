"""Key names of the Redis tier (``ns`` the namespace, ``key`` the cache key)::

    kc:<ns>:e:{<key>}                  the record (format.py): a small entry inline,
                                       or the manifest of a chunked one
    kc:<ns>:c:{<key>}:<write id>:<i>   chunk i of a large entry, a fresh write id per put
    kc:<ns>:lock:{<key>}               the single-flight lease (lease.py)

The braces are a Redis Cluster hash tag: only ``<key>`` decides the slot, so
an entry's record, chunks and lease live on one node and the Lua publish
script and the lease stay atomic there. On a single server they are just
characters. (Format version 1 used the same names without braces.)
"""

from __future__ import annotations

from kernelcache.stores.base import is_valid_key


class Layout:
    """The names of one namespace."""

    __slots__ = ("_chunks", "_entries", "_locks", "entry_pattern")

    def __init__(self, namespace: str) -> None:
        prefix = f"kc:{namespace}:"
        self._entries = prefix + "e:{"
        self._chunks = prefix + "c:{"
        self._locks = prefix + "lock:{"
        #: SCAN MATCH pattern of every record name (braces are literal in Redis globs).
        self.entry_pattern = self._entries + "*}"

    def entry(self, key: str) -> str:
        return f"{self._entries}{key}}}"

    def chunk_base(self, key: str) -> str:
        """Chunk names of ``key`` are this, then ``<write id>:<i>``."""
        return f"{self._chunks}{key}}}:"

    def lock(self, key: str) -> str:
        return f"{self._locks}{key}}}"

    def key_of(self, name: bytes) -> str | None:
        """The cache key of a record name from SCAN, or ``None`` if it is not one of ours."""
        text = name.decode(errors="replace")
        if not text.startswith(self._entries) or not text.endswith("}"):
            return None
        key = text[len(self._entries) : -1]
        return key if is_valid_key(key) else None
