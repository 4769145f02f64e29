"""Which cache Triton's managers use: one per cache directory, found again for every compile.

Triton makes a manager per compile and reads its cache directory each time
(``TRITON_CACHE_DIR`` or ``triton.knobs.cache.dir``; Triton's tests point it
at a fresh directory per test). So :func:`current` resolves the directory for
every manager, in this order:

1. the cache given to :func:`set_cache` (tests, embedding applications);
2. ``KERNELCACHE_TRITON_DIR``;
3. Triton's own cache directory, when ``TRITON_CACHE_DIR`` or the knob is set:
   then ``rm -rf $TRITON_CACHE_DIR``, or a fresh directory, is a cold cache,
   as Triton's users and tests expect;
4. otherwise the shared kernelcache directory (``KERNELCACHE_DIR`` or the
   platform's user cache directory), where ``kernelcache stats`` looks.

Each directory gets one :class:`Setup`, opened on first use from the
``KERNELCACHE_*`` environment: a :class:`~kernelcache.triton.pinned.PinnedTier`
in front of the disk tier (and Redis when ``KERNELCACHE_REMOTE`` is set).
A directory removed or replaced since it was opened is opened again.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import Any

from kernelcache.cache import DEFAULT_TIMEOUT, Cache
from kernelcache.errors import ConfigError
from kernelcache.keys import KeyBuilder
from kernelcache.settings import Settings
from kernelcache.tiers import default_tiers
from kernelcache.triton.pinned import PinnedTier

try:  # Triton 3.4+; older ones read TRITON_CACHE_DIR only
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    _knobs = None

NAMESPACE = "kernelcache.triton"
ENV_DIR = "KERNELCACHE_TRITON_DIR"
ENV_MAX_SIZE = "KERNELCACHE_TRITON_MAX_SIZE"
ENV_NAMESPACE = "KERNELCACHE_TRITON_NAMESPACE"
ENV_TIMEOUT = "KERNELCACHE_TRITON_TIMEOUT"
TRITON_DIR = "TRITON_CACHE_DIR"
#: Directories whose setups are kept at once (Triton's tests use one per test).
MAX_SETUPS = 8

COUNTERS = (
    "group_hits",
    "group_misses",
    "group_waits",
    "groups_published",
    "file_hits",
    "file_misses",
    "files_published",
    "unusable_entries",
    "claims_abandoned",
    "claims_expired",
)


class Setup:
    """What the managers of one cache share: the Cache, the key namespace, the claim timeout.

    ``directory`` is the disk tier's directory, if any: when it is removed or
    replaced, :meth:`intact` turns false and :func:`current` opens it again.
    """

    def __init__(
        self,
        cache: Cache,
        namespace: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        directory: str | None = None,
    ) -> None:
        self.cache = cache
        self.namespace = namespace
        self.timeout = timeout
        self.directory = directory
        self._identity = _identity(directory)

    def __repr__(self) -> str:
        return f"Setup({self.cache!r}, namespace={self.namespace!r}, timeout={self.timeout})"

    def intact(self) -> bool:
        """Whether the directory is still the one this setup opened (one ``stat``)."""
        return self._identity is None or _identity(self.directory) == self._identity

    def key(self, kind: str, triton_key: str, filename: str) -> str:
        """The kernelcache key of one Triton group (``kind="group"``) or file."""
        return entry_key(self.namespace, kind, triton_key, filename)


def _identity(directory: str | None) -> tuple[int, int] | None:
    if directory is None:
        return None
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@functools.lru_cache(maxsize=8)
def _prefix(namespace: str) -> KeyBuilder:
    return KeyBuilder(NAMESPACE).add("namespace", namespace)


@functools.lru_cache(maxsize=4096)
def entry_key(namespace: str, kind: str, triton_key: str, filename: str) -> str:
    """The key of one Triton group or file (memoised: it is computed on every hit)."""
    return _prefix(namespace).copy().add("file", (kind, triton_key, filename)).hexdigest()


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.explicit: Setup | None = None
        self.by_dir: dict[str | None, Setup] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)

    def after_fork_in_child(self) -> None:
        # Another thread may have held the lock at the fork; the child has no such thread.
        self.lock = threading.Lock()


_registry = _Registry()
os.register_at_fork(after_in_child=_registry.after_fork_in_child)


def count(name: str) -> None:
    with _registry.lock:
        _registry.counters[name] += 1


def counters() -> dict[str, int]:
    """This process's Triton counters (hits, misses, waits, ... since start)."""
    with _registry.lock:
        return dict(_registry.counters)


def triton_directory() -> str | None:
    """Triton's cache directory if the user set one (``TRITON_CACHE_DIR`` or the knob), else ``None``."""
    if _knobs is None:  # pragma: no cover - depends on the installed Triton
        return os.environ.get(TRITON_DIR) or None
    value = _knobs.cache.dir
    if not value:
        return None
    if os.environ.get(TRITON_DIR) or value != _knobs.cache.get_triton_dir("cache"):
        return str(value)
    return None  # Triton's default (~/.triton/cache): nobody asked for it


def cache_directory() -> str | None:
    """The directory Triton's cache lives in now; ``None``: kernelcache's own (``KERNELCACHE_DIR``)."""
    return os.environ.get(ENV_DIR) or triton_directory()


def current(*, check: bool = True) -> Setup:
    """The setup for the cache directory in effect now (see the module docstring).

    With ``check=False`` a directory opened before is not checked for removal
    (one ``stat`` saved): for hits, whose intact files prove it; a miss then
    calls :func:`refresh`.
    """
    explicit = _registry.explicit
    if explicit is not None:
        return explicit
    directory = cache_directory()
    setup = _registry.by_dir.get(directory)
    if setup is not None and (not check or setup.intact()):
        return setup
    with _registry.lock:
        setup = _registry.by_dir.get(directory)
        if setup is None or not setup.intact():
            setup = _open(directory)
            _registry.by_dir.pop(directory, None)
            while len(_registry.by_dir) >= MAX_SETUPS:
                # The oldest goes; managers still using it keep it alive until they finish.
                _registry.by_dir.pop(next(iter(_registry.by_dir)))
            _registry.by_dir[directory] = setup
        return setup


def refresh(setup: Setup) -> Setup:
    """``setup``, or the one to use instead if its directory was removed or replaced since."""
    return setup if setup.intact() else current()


def _open(directory: str | None) -> Setup:
    settings = Settings.load(dir=directory, max_bytes=os.environ.get(ENV_MAX_SIZE) or None)
    tiers = default_tiers(settings)
    persistent = [tier for tier in tiers if not tier.in_process]
    if persistent:
        # The memory tier would serve a group after its files were removed (and
        # extract them again): the pinned tier serves only while they are intact.
        tiers = [PinnedTier(max_bytes=settings.memory_max_bytes), *persistent]
    local = next((tier.local_dir for tier in tiers if tier.local_dir is not None), None)
    return Setup(Cache(tiers, settings=settings), _namespace(), _timeout(), local)


def _namespace() -> str:
    return os.environ.get(ENV_NAMESPACE, "")


def _timeout() -> float:
    text = os.environ.get(ENV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ConfigError(f"{ENV_TIMEOUT} must be a number of seconds >= 0 (or inf), not {text!r}")
    return value


def set_cache(cache: Cache | None, namespace: str | None = None) -> None:
    """Use ``cache`` (and key ``namespace``) for Triton from now on.

    ``None`` goes back to the caches the environment selects (the module
    docstring); a directory opened before keeps the settings it was opened with.
    """
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"set_cache takes a kernelcache.Cache, not {type(cache).__name__}")
    setup = None
    if cache is not None:
        setup = Setup(cache, namespace if namespace is not None else _namespace(), _timeout())
    with _registry.lock:
        _registry.explicit = setup


def get_cache() -> Cache:
    """The cache Triton's managers use now (see :func:`current`)."""
    return current().cache


def stats() -> dict[str, Any]:
    """This process's Triton counters plus the current cache's per-tier statistics."""
    return {"triton": counters(), **current().cache.stats()}
