"""A first run's key, derived while TileLang lowers the kernel (issue 23).

With an empty memo (a first run, a new cache directory, a new TileLang),
the key's shared fields take ~0.15 s to derive: the header trees are hashed
and the compilers probed, in the background threads that
:func:`kernelcache.tilelang.keys.prefetch` starts at ``install()``. Waiting
for them before the compile put that time on the compile's path. Instead,
:class:`FirstRun` lets TileLang start at once (TVM's lowering passes need no
key), and derives the key, looks it up and claims it just before the device
code generation, whose nvcc run is the compile's cost
(:func:`wrap_codegen`, calling
:func:`kernelcache.tilelang.recording.capturing`'s ``decide``):

- the key is free: this process leads the compile, nvcc runs, and the caller
  publishes the entry through :attr:`FirstRun.claim` (after handing the kernel back);
- the entry is there (another process compiled it while this one lowered, or
  a team tier holds it): :meth:`FirstRun.decide` raises :class:`EntryFound`,
  which ends the compile before the code generation, and the caller loads
  :attr:`FirstRun.entry`.

The seam is a Python function: an exception raised inside TVM's code
generation (from ``compile_cuda``, where ``decide`` runs only if the seam
was missed) crosses TVM's FFI as a ``RuntimeError``, after ~2 s spent
symbolizing a C++ backtrace. Either way the state kept here, not the
exception's type, tells the caller what happened (and an error of the lookup
itself is raised again as it was).

Only the ``tvm_ffi`` backend is served this way: its one nvcc run is
TileLang's ``compile_cuda`` (:data:`kernelcache.tilelang.manifest.BACKENDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.singleflight import Claim
from kernelcache.tilelang import recording


def wrap_codegen(original: Callable[..., Any]) -> Callable[..., Any]:
    """``tilelang.engine.lower.device_codegen``, deciding a pending first-run key first."""

    def device_codegen(*args: Any, **kwargs: Any) -> Any:
        recording.decide_now()
        return original(*args, **kwargs)

    return device_codegen


class EntryFound(RuntimeError):
    """Raised into TileLang to end a compile whose entry was found before nvcc ran."""


class FirstRun:
    """The key of one compile, decided just before its nvcc run (see the module docstring)."""

    def __init__(
        self, cache: Cache, derive: Callable[[], tuple[str | None, str, int | None]]
    ) -> None:
        self.cache = cache
        self.derive = derive
        #: ``(pre-key, key, walk start)`` once :meth:`decide` ran (``BackendHooks._key``).
        self.pre: str | None = None
        self.key: str | None = None
        self.started: int | None = None
        #: The right to publish, when this compile leads.
        self.claim: Claim | None = None
        #: The entry found before nvcc ran: the compile was ended, load this.
        self.entry: Entry | None = None
        #: What the lookup itself raised, to raise again as it was.
        self.error: BaseException | None = None

    @property
    def decided(self) -> bool:
        return self.key is not None or self.error is not None

    def decide(self) -> int | None:
        """Derive, look up and claim the key; the walk's start when a manifest is to be
        recorded (:func:`kernelcache.tilelang.recording.capturing`), else ``None``.

        Raises :class:`EntryFound` (into TileLang) when the entry is there or the
        lookup failed; the attributes say which.
        """
        try:
            self.pre, self.key, self.started = self.derive()
            entry = self.cache.get(self.key)
            if entry is None:
                claim = self.cache.claim(self.key)
                if claim.entry is None:
                    self.claim = claim
                    return recording.walk_start(self.cache, self.pre, self.started)
                entry = claim.entry
            self.entry = entry
        except BaseException as exc:  # raised again by the caller, as it was
            self.error = exc
            raise EntryFound("kernelcache: the key lookup failed") from exc
        raise EntryFound("kernelcache: the entry was found before nvcc ran")

    def outcome(self, exc: BaseException) -> Entry:
        """After the compile raised ``exc``: the entry to load, else the error to raise."""
        if self.claim is not None:
            self.claim.fail()  # the compile failed after the claim: the waiters go on
        if self.error is not None:
            raise self.error
        if self.entry is not None:
            return self.entry
        raise exc
