"""torch's remote-cache backend over kernelcache's tiers, compiled once per team.

torch 2.13 builds each remote cache (``RemoteFxGraphCache``,
``RemoteAOTAutogradCache``, ``RemoteAutotuneCache``,
``RemoteBundledAutotuneCache``) around ``cls.backend_override_cls()`` when that
is set: a bytes store with ``get(key)`` and ``put(key, data)``. The values are
torch's JSON documents, which for the FX graph and AOTAutograd caches hold a
base64 pickle: code. :class:`Backend` stores each one as a kernelcache entry
(artifact ``value``) under a :class:`~kernelcache.keys.KeyBuilder` key of
torch's own key, so it is verified, capped, counted and shared like any
other entry.

Single-flight. torch calls ``get``, compiles on a miss, then ``put``s. A
miss therefore takes the cache's claim (:meth:`kernelcache.Cache.claim`): of
N processes or machines missing the same key, one leads and compiles, the
others wait in ``get`` and return its value. The claim is released by the
``put``; a compile that never puts (torch bypassed its cache, or failed) gives
it up when its ``torch.compile`` call ends (:meth:`Flights.end_compile`),
when a later call finds it older than the timeout, or at exit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch._inductor.remote_cache import RemoteCacheBackend

from kernelcache import bytecache
from kernelcache.bytecache import VALUE, Flights, is_team_tier, unsigned_team_tiers
from kernelcache.keys import KeyBuilder

if TYPE_CHECKING:
    from kernelcache.cache import Cache

__all__ = [
    "NAMESPACE",
    "VALUE",
    "Flights",
    "Service",
    "backend_class",
    "cache_id",
    "entry_key",
    "is_team_tier",
    "unsigned_team_tiers",
]

#: Key namespace; bump the version when the entry layout changes.
NAMESPACE = "torch.compile/1"


def entry_key(torch_key: str, torch_version: str | None = None) -> str:
    """The kernelcache key of a torch remote-cache key (``pt2:fx-graph-v1::...:c1``).

    ``torch_version`` defaults to the installed torch's, build tag included
    (``2.15.0+cu132``). torch hashes its own version and source into its FX
    graph and AOTAutograd keys, not into every autotune key: with it here, two
    releases (or two builds of one) never share an entry, whatever the key's shape.
    """
    version = str(torch.__version__) if torch_version is None else torch_version
    return KeyBuilder(NAMESPACE).add("torch", version).add("torch_key", torch_key).hexdigest()


def cache_id(torch_key: str) -> str:
    """Which of torch's caches a key belongs to (``fx-graph-v1``), for ``kernelcache ls``."""
    head, sep, _ = torch_key.partition("::")
    return head.removeprefix("pt2:") if sep else "unknown"


class Service(bytecache.Service):
    """What every :class:`Backend` instance reads and writes through (the shared
    :class:`kernelcache.bytecache.Service`, keyed and labelled for torch)."""

    def __init__(
        self,
        cache: Callable[[], Cache],
        count: Callable[[str], None],
        timeout: Callable[[], float],
    ) -> None:
        super().__init__(
            cache,
            count,
            timeout,
            key=entry_key,
            meta=lambda torch_key: {"torch_cache": cache_id(torch_key)},
            name="inductor",
        )


def backend_class(service: Callable[[], Service]) -> type[RemoteCacheBackend[bytes]]:
    """A ``backend_override_cls`` for torch: built with no arguments, as torch calls it."""

    class Backend(RemoteCacheBackend[bytes]):
        """kernelcache as one of torch's remote caches (see :mod:`kernelcache.inductor.backend`)."""

        def _get(self, key: str) -> bytes | None:
            return service().get(key)

        def _put(self, key: str, data: bytes) -> None:
            service().put(key, data)

    return Backend
