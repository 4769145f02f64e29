"""kernelcache as JAX's persistent cache backend: a ``CacheInterface`` over the shared byte cache.

JAX reads and writes its persistent cache through one object, the module
global ``jax._src.compilation_cache._cache``: ``get(key) -> bytes | None``
before compiling, ``put(key, bytes)`` after, with the value compressed (a
4-byte compile time, then the serialized executable). :class:`Backend` is
that object over :class:`kernelcache.bytecache.Service`, so every executable
is a kernelcache entry (verified, capped, counted, shared, compiled once).

When does a compile end without a ``put``? When it took less than
``jax_persistent_cache_min_compile_time_secs``, when this is not process 0,
when it has host callbacks, or when it raised. JAX times every
``compile_or_get_cached`` call, the ``put`` included, and reports the
duration as ``/jax/core/compile/backend_compile_duration`` in the compiling
thread, whatever the outcome; :func:`compile_ended` listens for it and gives
up that thread's open claims, so that the processes waiting for it stop
waiting at once.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable

from jax._src.compilation_cache_interface import CacheInterface

from kernelcache.bytecache import Service
from kernelcache.jax import keys

__all__ = ["COMPILE_EVENT", "Backend", "compile_ended", "current", "listen"]

#: Recorded by JAX after each ``compile_or_get_cached`` call (``jax._src.dispatch``).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Backend(CacheInterface):
    """JAX's cache object: every call goes to the service in force (``service()``)."""

    def __init__(self, service: Callable[[], Service], path: str) -> None:
        self._service = service
        self._path = pathlib.Path(path)  # what JAX's reset_cache() logs

    def get(self, key: str) -> bytes | None:
        return self._service().get(key)

    def put(self, key: str, value: bytes) -> None:
        service = self._service()
        keys.note(service.key(key), key)  # for `kernelcache explain`: a put, never a hit
        service.put(key, value)


# JAX's listeners cannot all be removed again on JAX 0.6 (no public unregister):
# one listener per process, registered on the first install, forwarding to the
# service installed now.
_current: list[Service] = []
_registered = threading.Lock()
_listening = False


def compile_ended(event: str, duration_secs: float, **kwargs: str | int) -> None:
    """JAX's duration listener: a compile call of this thread is over."""
    if event == COMPILE_EVENT and _current:
        _current[0].flights.end_compile()


def current() -> Service | None:
    """The service installed now (``None`` when kernelcache is not JAX's cache)."""
    return _current[0] if _current else None


def listen(service: Service) -> Callable[[], None]:
    """Make ``service`` the one told about ended compiles; returns the undo."""
    global _listening
    with _registered:
        if not _listening:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(compile_ended)
            _listening = True
        _current[:] = [service]

    def stop() -> None:
        with _registered:
            if _current and _current[0] is service:
                _current.clear()

    return stop
