"""One shape for the ``install()`` / ``uninstall()`` / ``enabled()`` integrations.

TileLang, ninetoothed and torch.compile each make kernelcache their cache by
replacing a few of the tool's own names. What they share lives here, once:

- the state: the :class:`~kernelcache.Cache` (``Cache()`` unless one was
  given), keyword options such as ``device``, and objects derived from them
  (rebuilt after the cache or an option changes);
- the patches (:class:`~kernelcache.patching.Patches`), applied on the first
  :meth:`Integration.install` and undone exactly by :meth:`Integration.uninstall`;
- the counters that each integration's ``stats()`` reports;
- the version check (:mod:`kernelcache.versions`): a release inside the
  integration's tested range installs; one outside it installs with one
  warning if every seam it needs is there; one lacking a seam keeps its own
  cache, with one line that names the seam;
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from kernelcache.cache import Cache
from kernelcache.patching import Patches
from kernelcache.versions import Range, Seam, Support, decide

__all__ = ["Counters", "Integration", "UntestedVersionWarning"]

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


class UntestedVersionWarning(RuntimeWarning):
    """An integration installed over a release of its tool outside its tested range."""


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
        tested: Range,
        seams: Sequence[Seam],
        counters: Iterable[str],
        hook: Callable[[Patches], None],
        keeps: str = "its own cache",
    ) -> None:
        self.name, self.tool, self.tested, self.seams, self.keeps = name, tool, tested, seams, keeps
        self.lock = threading.RLock()
        self.patches = Patches()
        self.counters = Counters(counters)
        self.cache: Cache | None = None
        self.options: dict[str, Any] = {}
        self._derived: dict[str, Any] = {}
        self._hook = hook
        self._warned: set[str] = set()  # untested versions already warned about

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

    def support(self, version: str) -> Support:
        """What this integration does with ``version`` of its tool; no warning."""
        return decide(self.tool, version, self.tested, self.seams)

    def supports(self, version: str, *, stacklevel: int = 2) -> bool:
        """Whether to install over ``version``: warns once for an untested release with
        every seam there, and on every refusal (``stacklevel`` as for
        :func:`warnings.warn`, counted from the caller)."""
        verdict = self.support(version)
        if verdict.status == "refused":
            warnings.warn(
                f"kernelcache.{self.name}: {verdict.reason}: {self.tool} keeps {self.keeps}",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
        elif verdict.status == "untested" and version not in self._warned:
            self._warned.add(version)
            warnings.warn(
                f"kernelcache.{self.name}: {verdict.reason}; installing",
                UntestedVersionWarning,
                stacklevel=stacklevel + 1,
            )
        return verdict.installs

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
