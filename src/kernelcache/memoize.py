"""In-process memoization of objects that cannot be serialised: kernel handles, launchers.

>>> @memoize(maxsize=64)
... def launcher(kernel, x, block=128):
...     return build_launcher(kernel, x.dtype, block)   # slow, returns an unpicklable handle
>>> launcher(add_kernel, x)          # miss: builds
>>> launcher(add_kernel, y)          # hit when y has x's shape, dtype, strides and device
>>> launcher.cache_info()            # CacheInfo(hits=1, misses=1, maxsize=64, currsize=1)

The key is the function's fingerprint (:func:`kernelcache.fingerprint.function`:
source, defaults, closure values, referenced globals and same-module helpers)
plus the arguments' structure: scalars by type and value, array-likes
(anything with ``.shape`` and ``.dtype``) by type, shape, dtype, strides and
device but not contents, functions by fingerprint, tuples, lists, dicts and
sets recursively, other objects by their own ``==``/``hash``.

Fingerprinting costs 120-200 µs here (it reads source), too much per call. It is
computed once, together with a list of cheap identity probes over everything
it read: each function's ``__code__`` and defaults, each closure cell, each
referenced global name, and the contents of mutable containers found there.
A call re-runs the probes (~2 µs for a function with one helper, see
benchmarks/bench_triton.py) and re-fingerprints only when one fails,
so rebinding a global helper, a closure variable or a default is a miss.
Lists, dicts and sets the function reads are part of the key by content, so
one it appends to on every call (a log) makes every call a miss: keep such
state in an object.
Not seen: in-place mutation of objects the fingerprint treats as opaque (it
never read their state), and of lists/dicts nested inside tuples.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, ParamSpec, Protocol, TypeVar, cast, overload

from kernelcache import fingerprint
from kernelcache.keys import encode

__all__ = ["CacheInfo", "Memo", "Memoized", "memoize"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
_MISSING = object()
_EMPTY_CELL = object()
_PLAIN = (type(None), bool, int, float, str, bytes)
_MUTABLE = (list, dict, set, bytearray)
_FUNCTIONS = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    functools.partial,
)


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int | None
    currsize: int


# Fingerprints that know when they are stale ---------------------------
class _Probes:
    """Identity checks over everything a fingerprint read; ``valid()`` is the fast path."""

    __slots__ = ("attrs", "cells", "containers", "globals")

    def __init__(self) -> None:
        self.attrs: list[tuple[Any, str, Any]] = []
        self.globals: list[tuple[dict[str, Any], str, Any]] = []
        self.cells: list[tuple[Any, Any]] = []
        self.containers: list[tuple[Any, Any]] = []

    def valid(self) -> bool:
        for obj, name, expected in self.attrs:
            if getattr(obj, name, _MISSING) is not expected:
                return False
        for namespace, name, expected in self.globals:
            if namespace.get(name, _MISSING) is not expected:
                return False
        for cell, expected in self.cells:
            if _cell_value(cell) is not expected:
                return False
        return all(_container_sig(c) == sig for c, sig in self.containers)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty cell: the name is assigned later
        return _EMPTY_CELL


def _container_sig(value: Any) -> Any:
    # Mirrors what fingerprint.function hashes for a container: its encoding,
    # or only type and length when it holds unencodable objects.
    try:
        return encode(sorted(value) if isinstance(value, set) else value)
    except TypeError:
        return (type(value), len(value))


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_names(const))
    return tuple(sorted(names))


def _watch(fn: Any, probes: _Probes, seen: set[int]) -> None:
    """Record probes for what ``fingerprint.function(fn)`` reads (same traversal)."""
    if isinstance(fn, functools.partial):
        _watch(fn.func, probes, seen)
        for arg in fn.args:
            _watch_value(arg, probes, seen, None, None)
        probes.containers.append((fn.keywords, _container_sig(fn.keywords)))
        for value in fn.keywords.values():
            _watch_value(value, probes, seen, None, None)
        return
    if hasattr(fn, "__wrapped__"):
        probes.attrs.append((fn, "__wrapped__", fn.__wrapped__))
        fn = inspect.unwrap(fn)
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType) or id(code) in seen:
        return
    seen.add(id(code))
    home = getattr(fn, "__module__", None)
    root = fingerprint.project_root(fn)
    for attr in ("__code__", "__defaults__", "__kwdefaults__"):
        probes.attrs.append((fn, attr, getattr(fn, attr, None)))
    for default in fn.__defaults__ or ():
        _watch_value(default, probes, seen, home, root)
    for default in (fn.__kwdefaults__ or {}).values():
        _watch_value(default, probes, seen, home, root)
    for cell in fn.__closure__ or ():
        value = _cell_value(cell)
        probes.cells.append((cell, value))
        _watch_value(value, probes, seen, home, root)
    namespace = getattr(fn, "__globals__", {})
    names = _names(code)
    for name in names:
        value = namespace.get(name, _MISSING)
        probes.globals.append((namespace, name, value))
        _watch_value(value, probes, seen, home, root)
        if isinstance(value, types.ModuleType) and fingerprint.same_project(value, root):
            # fingerprint.function follows the functions the code names in it
            space = vars(value)
            for attr in names:
                probes.globals.append((space, attr, space.get(attr, _MISSING)))
                _watch_value(space.get(attr, _MISSING), probes, seen, home, root)


def _watch_value(
    value: Any, probes: _Probes, seen: set[int], home: str | None, root: str | None
) -> None:
    if isinstance(value, _PLAIN) or value is _MISSING or value is _EMPTY_CELL:
        return
    if isinstance(value, _MUTABLE):
        probes.containers.append((value, _container_sig(value)))
    elif isinstance(value, functools.partial) or (
        callable(value)
        and not isinstance(value, type)
        and (
            (home is not None and getattr(value, "__module__", None) == home)
            or fingerprint.same_project(value, root)
        )
    ):
        _watch(value, probes, seen)


class _Fingerprint:
    """One function's fingerprint, recomputed only when its probes fail."""

    __slots__ = ("_snapshot", "fn")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._snapshot: tuple[_Probes, str] | None = None

    def get(self) -> str:
        snapshot = self._snapshot  # one read: another thread may replace it
        if snapshot is not None and snapshot[0].valid():
            return snapshot[1]
        probes = _Probes()
        _watch(self.fn, probes, set())  # probes first: a change in between fails them
        digest = fingerprint.function(self.fn)
        self._snapshot = (probes, digest)
        return digest


class _FingerprintRegistry:
    """Fingerprints of callables passed as arguments, LRU-bounded.

    Entries hold their function strongly, so an ``id`` is never reused while
    it is a key here.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[int, _Fingerprint] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fn: Callable[..., Any]) -> str:
        with self._lock:
            state = self._data.get(id(fn))
            if state is None or state.fn is not fn:
                state = self._data[id(fn)] = _Fingerprint(fn)
                if len(self._data) > self.maxsize:
                    self._data.popitem(last=False)
            else:
                self._data.move_to_end(id(fn))
        return state.get()


_registry = _FingerprintRegistry()


# Argument structure ----------------------------------------------------
def _arg_key(value: Any) -> Hashable:
    """A hashable, type-tagged key for one argument (see the module docstring)."""
    kind = type(value)
    if value is None or kind in (bool, int, str, bytes):
        return (kind, value)
    if kind is float:
        return (float, value.hex())  # one NaN; -0.0 differs from 0.0
    if kind in (tuple, list):
        return (kind, tuple(map(_arg_key, value)))
    if kind is dict:
        return (dict, frozenset((_arg_key(k), _arg_key(v)) for k, v in value.items()))
    if isinstance(value, numbers.Number):  # numpy scalars register here
        return _number_key(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):  # e.g. numpy.bool_
        return (kind, value.item())
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _array_key(value)
    if isinstance(value, (set, frozenset)):
        return (kind, frozenset(map(_arg_key, value)))
    if isinstance(value, (tuple, list, dict)):  # subclasses (namedtuples, ...)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return (kind, tuple((_arg_key(k), _arg_key(v)) for k, v in items))
    if isinstance(value, _FUNCTIONS):
        if isinstance(value, types.MethodType):
            owner = value.__self__
            return ("method", _arg_key(owner), _registry.get(value.__func__))
        return ("function", _registry.get(value))
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"memoize cannot key an argument of type {kind.__module__}.{kind.__qualname__}: "
            "it is not hashable, array-like (.shape/.dtype), a function or a container"
        ) from None
    return (kind, value)


def _number_key(value: Any) -> Hashable:
    kind = type(value)
    if isinstance(value, numbers.Integral):
        return (kind, int(value))
    if isinstance(value, numbers.Real):
        return (kind, float(value).hex())
    if isinstance(value, numbers.Complex):
        return (kind, complex(value).real.hex(), complex(value).imag.hex())
    return (kind, value)


def _array_key(value: Any) -> Hashable:
    strides = getattr(value, "strides", None)
    if strides is None and callable(getattr(value, "stride", None)):
        strides = value.stride()  # torch spells it as a method
    return (
        "array",
        type(value),
        tuple(value.shape),
        str(value.dtype),
        None if strides is None else tuple(strides),
        str(getattr(value, "device", "")),
    )


# The cache -------------------------------------------------------------
class Memo:
    """A bounded, thread-safe LRU of ``fn(*args, **kwargs)`` results keyed by content.

    Concurrency: one lock guards the table; the function runs outside it. Two
    threads missing the same key do not both build: the second waits for the
    first and then hits (or builds itself if the first raised).
    """

    def __init__(self, maxsize: int | None = 128) -> None:
        if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 0):
            raise ValueError(f"maxsize must be a non-negative int or None, not {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._building: dict[Hashable, tuple[int, threading.Event]] = {}
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)``, from the cache when an equal call was made before."""
        return self.call_as(_registry.get(fn), fn, args, kwargs)

    def call_as(self, digest: str, fn: Callable[..., R], args: Any, kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` memoised under ``digest``, the caller's fingerprint of ``fn``."""
        key = (digest, _arg_key(args), _arg_key(kwargs) if kwargs else None)
        me = threading.get_ident()
        while True:
            with self._lock:
                if key in self._data:
                    self._data.move_to_end(key)
                    self._hits += 1
                    return self._data[key]  # type: ignore[no-any-return]
                building = self._building.get(key)
                if building is None or building[0] == me:  # re-entrant call: no self-wait
                    self._misses += 1
                    done = threading.Event()
                    self._building[key] = (me, done)
                    break
            building[1].wait()
        try:
            value = fn(*args, **kwargs)
        finally:
            with self._lock:
                self._building.pop(key, None)
            done.set()
        self._store(key, value)
        return value

    def _store(self, key: Hashable, value: Any) -> None:
        if self.maxsize == 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if self.maxsize is not None:
                while len(self._data) > self.maxsize:
                    self._data.popitem(last=False)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.maxsize, len(self._data))

    def clear(self) -> None:
        """Drop every cached result and reset the counters."""
        with self._lock:
            self._data.clear()
            self._hits = self._misses = 0

    cache_clear = clear


class Memoized(Protocol[P, R_co]):
    """What :func:`memoize` returns: the function, plus its :class:`Memo`'s controls."""

    memo: Memo

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...
    def cache_info(self) -> CacheInfo: ...
    def cache_clear(self) -> None: ...


@overload
def memoize(fn: Callable[P, R], *, maxsize: int | None = 128) -> Memoized[P, R]: ...
@overload
def memoize(
    fn: None = None, *, maxsize: int | None = 128
) -> Callable[[Callable[P, R]], Memoized[P, R]]: ...
def memoize(
    fn: Callable[P, R] | None = None, *, maxsize: int | None = 128
) -> Memoized[P, R] | Callable[[Callable[P, R]], Memoized[P, R]]:
    """Decorate ``fn`` with its own :class:`Memo`: ``@memoize`` or ``@memoize(maxsize=...)``.

    The wrapper has ``cache_info()``, ``cache_clear()`` and ``memo``.
    """

    def decorate(func: Callable[P, R]) -> Memoized[P, R]:
        memo = Memo(maxsize)
        state = _Fingerprint(func)  # computed at the first call: helpers may be defined later

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return memo.call_as(state.get(), func, args, kwargs)

        memoized = cast(Memoized[P, R], wrapper)  # given its attributes just below
        memoized.cache_info = memo.cache_info  # type: ignore[method-assign]
        memoized.cache_clear = memo.clear  # type: ignore[method-assign]
        memoized.memo = memo
        return memoized

    return decorate if fn is None else decorate(fn)
