"""One shape for the ``install()`` / ``uninstall()`` / ``enabled()`` integrations.

TileLang, ninetoothed and torch.compile each make kernelcache their cache by
replacing a few of the tool's own names. What they share lives here, once:

- the state: the :class:`~kernelcache.Cache` (``Cache()`` unless one was
  given), keyword options such as ``device``, and objects derived from them
  (rebuilt after the cache or an option changes);
- the patches (:class:`~kernelcache.patching.Patches`), applied on the first
  :meth:`Integration.install` and undone exactly by :meth:`Integration.uninstall`;
- the counters that each integration's ``stats()`` reports;
- the version check against the integration's ``SUPPORTED_VERSIONS``: any
  other version keeps its own cache, with a warning;
- :meth:`Integration.enabled`, which restores exactly the state before the
  block: a nested ``enabled(cache=B)`` inside ``install(cache=A)`` leaves A
  installed afterwards (issue 19, item 10).

An integration writes only its seams (the ``hook`` that fills the patches)
and its keys.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from kernelcache.cache import Cache
from kernelcache.patching import Patches

__all__ = ["Counters", "Integration"]

T = TypeVar("T")


class Counters:
    """Named event counts of one integration in this process; thread-safe."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(names, 0)

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            if name not in self.values:
                raise KeyError(f"no counter {name!r}; counters: {', '.join(self.values)}")
            self.values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class Integration:
    """The life cycle of one integration: state, patches, counters, versions.

    ``hook(patches)`` installs the integration's seams; it runs under the
    lock on the first :meth:`install` after construction or :meth:`uninstall`,
    and reads the state (``get_cache``, ``option``) when called, so a later
    :meth:`install` with another cache needs no re-patching.
    """

    def __init__(
        self,
        name: str,
        *,
        tool: str,
        supported: tuple[str, ...],
        counters: Iterable[str],
        hook: Callable[[Patches], None],
        keeps: str = "its own cache",
    ) -> None:
        self.name, self.tool, self.supported, self.keeps = name, tool, supported, keeps
        self.lock = threading.RLock()
        self.patches = Patches()
        self.counters = Counters(counters)
        self.cache: Cache | None = None
        self.options: dict[str, Any] = {}
        self._derived: dict[str, Any] = {}
        self._hook = hook

    # State -----------------------------------------------------------------
    def get_cache(self) -> Cache:
        """The cache in use: the one given to :meth:`install`, else one ``Cache()``."""
        with self.lock:
            if self.cache is None:
                self.cache = Cache()
            return self.cache

    def option(self, name: str) -> Any:
        """A keyword option of the last :meth:`install` (``None`` when not given)."""
        return self.options.get(name)

    def derived(self, name: str, build: Callable[[], T]) -> T:
        """``build()``'s result, kept until the cache or options change."""
        with self.lock:
            if name not in self._derived:
                self._derived[name] = build()
            value: T = self._derived[name]
            return value

    def count(self, name: str) -> None:
        self.counters.count(name)

    def _configure(self, cache: Cache | None, options: dict[str, Any]) -> None:
        self.cache, self.options, self._derived = cache, dict(options), {}

    # Life cycle ------------------------------------------------------------
    def installed(self) -> bool:
        return bool(self.patches)

    def supports(self, version: str, *, stacklevel: int = 2) -> bool:
        """Whether ``version`` of the tool is one the seams were read from; warns if not
        (``stacklevel`` as for :func:`warnings.warn`, counted from the caller)."""
        if version in self.supported:
            return True
        warnings.warn(
            f"kernelcache.{self.name} supports {self.tool} {', '.join(self.supported)}, "
            f"not {version}: {self.tool} keeps {self.keeps}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
        return False

    def install(self, version: str, cache: Cache | None, options: dict[str, Any]) -> bool:
        """Use ``cache`` and ``options`` and patch once; ``False`` for an unsupported version."""
        if not self.supports(version, stacklevel=3):  # the user's call of install()
            return False
        with self.lock:
            self._configure(cache, options)
            if not self.installed():
                self._patch()
        return True

    def _patch(self) -> None:
        try:
            self._hook(self.patches)
        except BaseException:
            self.patches.restore()  # half a hook is no hook
            raise

    def uninstall(self) -> None:
        """Undo every patch; the cache and options stay for ``get_cache``."""
        with self.lock:
            self.patches.restore()

    @contextlib.contextmanager
    def enabled(self, install: Callable[[], bool]) -> Iterator[bool]:
        """Run ``install()`` for the block, then restore exactly the state before it."""
        with self.lock:
            was = self.installed()
            saved = (self.cache, dict(self.options), self._derived)
        try:
            yield install()
        finally:
            with self.lock:
                if not was:
                    self.uninstall()
                self.cache, self.options, self._derived = saved
                if was and not self.installed():  # the block uninstalled: put it back
                    self._patch()
