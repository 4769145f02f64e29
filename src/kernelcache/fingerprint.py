"""Fingerprints of things that change a compiled binary: functions, files, environment.

Each returns a hex string that can go into a :class:`~kernelcache.keys.KeyBuilder`
field. Nothing here hashes an absolute path, a process id, an object address or
a timestamp, so the same inputs give the same fingerprint in another process,
user or machine.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import textwrap
import types
from collections.abc import Callable, Iterable
from typing import Any

from kernelcache.keys import KeyBuilder, encode

_PLAIN = (type(None), bool, int, float, str, bytes)


def function(fn: Callable[..., Any]) -> str:
    """Fingerprint a callable by what determines its behaviour.

    Covers the source (or bytecode when no source exists), default values,
    closure cells, and the globals it references; helper functions defined in
    the same module are fingerprinted recursively (cycles are cut). Nested
    ``functools.partial`` objects contribute their function, args and kwargs.
    Builtins and other callables without code fall back to module + qualname.
    Opaque objects (neither plain values, callables, modules nor classes)
    contribute only their type's name: pass them as explicit key fields if
    their state matters.
    """
    builder = KeyBuilder("kernelcache.fingerprint.function")
    _add_callable(builder, fn, set())
    return builder.hexdigest()


def _qualified(obj: Any) -> str:
    return (
        f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    )


def _add_value(
    builder: KeyBuilder, label: str, value: Any, seen: set[int], home: str | None
) -> None:
    """Mix in a value found in defaults, closures, globals or partial arguments."""
    if isinstance(value, _PLAIN):
        builder.add(label, value)
    elif isinstance(value, (list, tuple, dict, frozenset, set)):
        try:
            encoded = encode(sorted(value) if isinstance(value, (set, frozenset)) else value)
        except TypeError:
            builder.add(label, ("opaque-container", type(value).__qualname__, len(value)))
        else:
            builder.add(label, ("container", encoded))
    elif isinstance(value, types.ModuleType):
        builder.add(label, ("module", value.__name__))
    elif isinstance(value, type):
        builder.add(label, ("class", _qualified(value)))
    elif callable(value):
        same_module = home is not None and getattr(value, "__module__", None) == home
        if isinstance(value, functools.partial) or same_module:
            builder.add(label, "callable")
            _add_callable(builder, value, seen)
        else:
            # A function of another module (a library) is identified by name:
            # following it would pull whole libraries into every key.
            builder.add(label, ("extern-callable", _qualified(value)))
    else:
        builder.add(label, ("opaque", _qualified(type(value))))


def _add_callable(builder: KeyBuilder, fn: Any, seen: set[int]) -> None:
    if isinstance(fn, functools.partial):
        builder.add("partial", len(fn.args))
        _add_callable(builder, fn.func, seen)
        for i, arg in enumerate(fn.args):
            _add_value(builder, f"partial.arg{i}", arg, seen, None)
        for name in sorted(fn.keywords):
            _add_value(builder, f"partial.kw.{name}", fn.keywords[name], seen, None)
        return
    fn = inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
    if isinstance(fn, types.MethodType):
        builder.add("bound-method-of", _qualified(type(fn.__self__)))
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        builder.add("named", _qualified(fn))
        return
    if id(code) in seen:  # recursion between helpers: the name is enough
        builder.add("cycle", fn.__qualname__)
        return
    seen.add(id(code))
    builder.add("qualname", fn.__qualname__)
    builder.add("code", _source_or_bytecode(fn, code))
    home = getattr(fn, "__module__", None)
    for i, default in enumerate(fn.__defaults__ or ()):
        _add_value(builder, f"default{i}", default, seen, home)
    for name in sorted(fn.__kwdefaults__ or {}):
        _add_value(builder, f"kwdefault.{name}", fn.__kwdefaults__[name], seen, home)
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell: the name is assigned later
            builder.add(f"closure.{name}", "empty-cell")
            continue
        _add_value(builder, f"closure.{name}", content, seen, home)
    fn_globals = getattr(fn, "__globals__", {})
    for name in sorted(_referenced_names(code)):
        if name in fn_globals:
            _add_value(builder, f"global.{name}", fn_globals[name], seen, home)


def _referenced_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referenced_names(const)
    return names


def _source_or_bytecode(fn: Any, code: types.CodeType) -> Any:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        # No source file (exec, REPL): the bytecode and constants are stable
        # for one interpreter version, which is part of every toolchain key.
        return ("bytecode", code.co_code, _consts(code), code.co_names)


def _consts(code: types.CodeType) -> list[Any]:
    out: list[Any] = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.append(("code", const.co_code, _consts(const), const.co_names))
        elif isinstance(const, _PLAIN):
            out.append(const)
        elif isinstance(const, (tuple, frozenset)):
            out.append(repr(sorted(map(repr, const))))
        else:
            out.append(type(const).__qualname__)
    return out


def files(
    paths: Iterable[str | os.PathLike[str]], root: str | os.PathLike[str] | None = None
) -> str:
    """Fingerprint files by name and content, never by absolute path or mtime.

    Names are taken relative to ``root`` when given (so a copy of a project in
    another directory fingerprints the same); without ``root`` a relative path
    is used as given and an absolute one by its base name.
    """
    builder = KeyBuilder("kernelcache.fingerprint.files")
    entries = []
    for path in paths:
        path = os.fspath(path)
        if root is not None:
            name = os.path.relpath(path, root)
        elif os.path.isabs(path):
            name = os.path.basename(path)
        else:
            name = os.path.normpath(path)
        content = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                content.update(chunk)
        entries.append((name.replace(os.sep, "/"), content.digest()))
    for name, digest in sorted(entries):
        builder.add(name, digest)
    return builder.hexdigest()


def env(names: Iterable[str]) -> str:
    """Fingerprint the values of chosen environment variables (unset differs from empty)."""
    builder = KeyBuilder("kernelcache.fingerprint.env")
    for name in sorted(set(names)):
        builder.add(name, os.environ.get(name))
    return builder.hexdigest()
