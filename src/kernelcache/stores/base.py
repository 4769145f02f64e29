"""The abstract base every storage tier implements.

A tier implements five methods (``get``, ``put``, ``delete``, ``keys``,
``close``) and keeps its counters in ``self.counters``; the base supplies the
rest. There is deliberately no ``__contains__``: ``if key in store:
store.get(key)`` races with other processes, and ``get`` answers both
questions at once.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import threading
from typing import TYPE_CHECKING, Any, Protocol

from kernelcache.errors import ReadOnlyStoreError

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import TracebackType
    from typing import Self

    from kernelcache.entry import Entry

#: What a key may be: it becomes a file name and part of a Redis key.
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


# Keys that passed the check, so the hot path (every Cache.get) skips it:
# a set lookup is ~50 ns, the check ~250 ns, and a memory hit must stay
# under 1 us. Bounded (cleared when full); plain str only, so a str subclass
# with its own __eq__/__hash__ cannot pass as an already-checked key.
_VALID_KEYS: set[str] = set()
_VALID_KEYS_MAX = 4096


def validate_key(key: object) -> str:
    """Return ``key`` if stores can use it as a name, else raise ``ValueError``.

    Keys become file names and Redis keys, so they are restricted to
    ``[A-Za-z0-9_.-]``, 1 to 200 characters, not starting with ``.`` or ``-``.
    Hex digests from :class:`~kernelcache.keys.KeyBuilder` always qualify.
    """
    if type(key) is str and key in _VALID_KEYS:
        return key
    if not isinstance(key, str) or not _is_key_text(key):
        raise ValueError(
            f"invalid cache key {key!r}: use 1-200 characters of [A-Za-z0-9_.-], "
            "not starting with '.' or '-' (KeyBuilder.hexdigest() gives one)"
        )
    if type(key) is str:
        if len(_VALID_KEYS) >= _VALID_KEYS_MAX:
            _VALID_KEYS.clear()
        _VALID_KEYS.add(key)
    return key


def _is_key_text(key: str) -> bool:
    # Its own characters: a str subclass may override what the regex looks at.
    text = str.__str__(key)
    # Every hex digest is 1-200 ASCII letters and digits: ~0.1 us without the regex, which
    # costs ~0.4 us on each key a fresh process reads for the first time (issue 40).
    return (text.isalnum() and text.isascii() and len(text) <= 200) or (
        _KEY.fullmatch(text) is not None
    )


def is_valid_key(key: object) -> bool:
    """Whether :func:`validate_key` accepts ``key``; listings skip names that fail it."""
    try:
        validate_key(key)
    except ValueError:
        return False
    return True


def bound(entry: Entry, key: str) -> Entry:
    """``entry`` as a tier without files of its own holds it: under ``key``."""
    return entry if entry.key == key else entry.bind(key)


def check_caps(max_bytes: int | None, max_entries: int | None) -> None:
    """Raise ``ValueError`` unless each size cap is a positive int or ``None``.

    The one rule for every tier's keyword-only caps: ``max_bytes`` counts
    bytes, ``max_entries`` counts entries, ``None`` means no cap.
    """
    for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
        if value is not None and (type(value) is not int or value <= 0):  # bool is no cap
            raise ValueError(f"{name} must be a positive int or None, not {value!r}")


#: Counters subclass -> its counter names (see Counters.names).
_COUNTER_NAMES: dict[type, tuple[str, ...]] = {}


@dataclasses.dataclass(eq=False)
class Counters:
    """What a tier did since this process opened it.

    Every tier has these; a tier with more to count subclasses it with more
    fields (the Redis tier counts timeouts, breaker trips and forged values).
    Statistics carry whatever counters a tier has.
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    errors: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False
    )

    @property
    def names(self) -> tuple[str, ...]:
        """The counters this tier keeps, in order."""
        cls = type(self)
        names = _COUNTER_NAMES.get(cls)
        if names is None:  # once per class: dataclasses.fields costs ~1 us, every put adds
            fields = dataclasses.fields(self)
            names = _COUNTER_NAMES[cls] = tuple(f.name for f in fields if f.name[0] != "_")
        return names

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` (may be negative) to counter ``name``, atomically across threads.

        Hot paths that already hold their tier's own lock may write the
        attribute directly (``counters.hits += 1``) instead.
        """
        if name not in self.names:
            raise TypeError(f"{type(self).__name__} has no counter {name!r}")
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.names}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counters) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]


class FlightLock(Protocol):
    """A lock that lets one compile of a key run at a time within a tier's reach.

    A disk tier's lock spans the processes of one machine; a remote tier's
    lock spans machines. ``acquire`` returns ``False`` when ``timeout``
    seconds pass first: the caller then compiles anyway (liveness beats
    deduplication). ``release`` is only called after a successful acquire.
    """

    def acquire(self, timeout: float) -> bool: ...

    def release(self) -> None: ...


@dataclasses.dataclass(slots=True)
class EntryInfo:
    """One stored entry as listings see it, without reading its artifacts."""

    key: str
    size: int
    last_access: float  # seconds since the epoch
    created: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Damage:
    """An entry that fails verification: which, why, and the state of the file checked.

    ``info`` describes the very entry that was checked, so that removing it
    (:meth:`Store.remove_if_unchanged`) never takes one published since.
    """

    __slots__ = ("info", "key", "reason", "removed")

    def __init__(self, info: EntryInfo, reason: str) -> None:
        self.key = info.key
        self.info = info
        self.reason = reason
        self.removed = False

    def __repr__(self) -> str:
        return f"Damage({self.key!r}, {self.reason!r}, removed={self.removed})"


class Store(abc.ABC):
    """One storage tier: ``key -> Entry``.

    Implementations translate their backend's errors into
    :class:`~kernelcache.errors.StoreError` and count misses, hits, puts,
    evictions and errors in ``self.counters``.
    """

    #: Short name used in statistics ("memory", "disk", "sqlite", "redis").
    kind: str = "store"

    #: The counters a tier of this class keeps; a tier that counts more names a subclass.
    counters_class: type[Counters] = Counters

    def __init__(self, *, read_only: bool = False) -> None:
        self.read_only = read_only
        self.counters = self.counters_class()
        self._closed = False

    @abc.abstractmethod
    def get(self, key: str) -> Entry | None:
        """The verified entry stored under ``key``, or ``None``.

        A damaged entry is a miss: it is removed and counted as corrupt.
        """

    @abc.abstractmethod
    def put(self, key: str, entry: Entry) -> Entry:
        """Store ``entry`` under ``key``, replacing any previous one atomically.

        Returns the entry as this tier now holds it, bound to ``key`` (see
        :meth:`Entry.bind`): from a tier that keeps files, its ``path()`` gives
        files inside the tier. ``entry`` itself is never modified.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if something was removed."""

    @abc.abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over stored keys (a snapshot; entries may come and go meanwhile)."""

    def flight_lock(self, key: str) -> FlightLock | None:
        """A lock for single-flight compiles of ``key``, or ``None`` if this tier has none."""
        return None

    def scan(self) -> Iterator[EntryInfo]:
        """Size and access time of every entry; tiers override this to avoid reading data."""
        for key in self.keys():
            entry = self.get(key)
            if entry is not None:
                yield EntryInfo(key, entry.nbytes, 0.0)

    def info(self, key: str) -> EntryInfo | None:
        """Size and times of one entry, or ``None``; tiers override this to avoid a scan."""
        validate_key(key)
        return next((info for info in self.scan() if info.key == key), None)

    def check(self, info: EntryInfo) -> Damage | None:
        """Why the entry ``info`` describes fails verification, or ``None`` if it is intact.

        This default reads it through :meth:`get` (which verifies every
        checksum, and removes a damaged entry unless the tier is read-only);
        tiers that can say more override it.
        """
        before = self.counters.corrupt
        if self.get(info.key) is None and self.counters.corrupt > before:
            damage = Damage(info, "fails verification")
            damage.removed = not self.read_only
            return damage
        return None

    def remove_if_unchanged(self, info: EntryInfo) -> bool:
        """Remove the entry ``info`` (from :meth:`scan` or :meth:`info`) describes.

        Tiers that can tell (the disk tier) keep an entry re-published since
        ``info`` was taken and return ``False``; others remove the key.
        """
        return self.delete(info.key)

    def sweep(self) -> None:  # noqa: B027  (optional: most tiers leave nothing behind)
        """Remove what crashed processes left behind (stale locks, staging); default: nothing."""

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)`` currently stored."""
        count = size = 0
        for info in self.scan():
            count += 1
            size += info.size
        return count, size

    #: Size cap in bytes, or ``None`` when the tier is unbounded.
    max_bytes: int | None = None
    #: Why the tier refuses to work at all (its directory is unsafe), or ``None``.
    unusable: str | None = None
    #: Whether entries live in this process (a hit costs well under a microsecond,
    #: so statistics sample such hits instead of counting each one).
    in_process: bool = False
    #: Whether other machines share the tier (the team tier): ``kernelcache prune``
    #: and ``clear`` leave such a tier alone unless given ``--remote``.
    shared: bool = False
    #: A directory of this machine that the tier owns, where statistics shared by
    #: every process using the tier are kept; ``None`` if it has none.
    local_dir: str | None = None

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        self._check_writable()
        return sum(1 for key in list(self.keys()) if self.delete(key))

    def close(self) -> None:
        """Release resources; the store must not be used afterwards."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters plus the tier's identity, for ``Cache.stats()``."""
        return {"kind": self.kind, "read_only": self.read_only, **self.counters.as_dict()}

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"{self!r} is read-only")

    def _count(self, name: str, amount: int = 1) -> None:
        self.counters.add(name, amount)

    def __enter__(self) -> Self:  # ``with SQLiteStore(p) as s``: s is a SQLiteStore
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
