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

    Covers the source and the code object (two lambdas on one line share
    their source line, not their bytecode), default values, closure cells,
    and the globals it references. Helper functions of the same project are
    fingerprinted recursively (cycles are cut): those of the same module, and
    those of other modules whose files lie under the same project root (the
    directory holding the function's top-level package or script), whether
    imported by name or used as ``module.helper``. Installed libraries are
    identified by name only. Nested ``functools.partial`` objects contribute
    their function, args and kwargs. Builtins and other callables without
    code fall back to module + qualname. Opaque objects (neither plain
    values, callables, modules nor classes) contribute only their type's
    name: pass them as explicit key fields if their state matters.
    """
    builder = KeyBuilder("kernelcache.fingerprint.function")
    _add_callable(builder, fn, set())
    return builder.hexdigest()


def _qualified(obj: Any) -> str:
    return (
        f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    )


def _project_root(module_name: str | None, file: object) -> str | None:
    """The directory holding the top-level package (or script) of a module's file."""
    if not module_name or not isinstance(file, str) or not file.endswith(".py"):
        return None
    root = os.path.dirname(os.path.abspath(file))
    depth = module_name.count(".") + (os.path.basename(file) == "__init__.py")
    for _ in range(depth if module_name != "__main__" else 0):
        root = os.path.dirname(root)
    return root


def project_root(fn: Any) -> str | None:
    """The root of the project a function's module belongs to (see :func:`function`)."""
    fn_globals = getattr(fn, "__globals__", None)
    if not isinstance(fn_globals, dict):
        return None
    return _project_root(fn_globals.get("__name__"), fn_globals.get("__file__"))


def same_project(value: Any, root: str | None) -> bool:
    """Whether ``value`` (a function or module) is code of the project under ``root``."""
    if root is None:
        return False
    if isinstance(value, types.ModuleType):
        other = _project_root(value.__name__, getattr(value, "__file__", None))
    else:
        other = project_root(value)
    return other == root


def _add_value(
    builder: KeyBuilder,
    label: str,
    value: Any,
    seen: set[int],
    home: str | None,
    root: str | None = None,
    names: frozenset[str] = frozenset(),
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
        if same_project(value, root):
            # ``helpers.scale(x)``: follow the project's functions the code names.
            for name in sorted(names):
                attr = getattr(value, name, None)
                if isinstance(attr, types.FunctionType) and same_project(attr, root):
                    builder.add(f"{label}.{name}", "callable")
                    _add_callable(builder, attr, seen)
    elif isinstance(value, type):
        builder.add(label, ("class", _qualified(value)))
    elif callable(value):
        same_module = home is not None and getattr(value, "__module__", None) == home
        if isinstance(value, functools.partial) or same_module or same_project(value, root):
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
    # The source is the whole line: two lambdas on it differ only here.
    builder.add("bytecode", _code_of(code))
    home = getattr(fn, "__module__", None)
    root = project_root(fn)
    for i, default in enumerate(fn.__defaults__ or ()):
        _add_value(builder, f"default{i}", default, seen, home, root)
    for name in sorted(fn.__kwdefaults__ or {}):
        _add_value(builder, f"kwdefault.{name}", fn.__kwdefaults__[name], seen, home, root)
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell: the name is assigned later
            builder.add(f"closure.{name}", "empty-cell")
            continue
        _add_value(builder, f"closure.{name}", content, seen, home, root)
    fn_globals = getattr(fn, "__globals__", {})
    names = frozenset(_referenced_names(code))
    for name in sorted(names):
        if name in fn_globals:
            _add_value(builder, f"global.{name}", fn_globals[name], seen, home, root, names)


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
        return ("bytecode", *_code_of(code))


def _code_of(code: types.CodeType) -> tuple[Any, ...]:
    """What a code object computes, without its positions (stable across processes)."""
    return (code.co_code, _consts(code), code.co_names, code.co_argcount, code.co_kwonlyargcount)


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
    is used as given, and absolute ones relative to the deepest directory
    holding them all: ``a/x.h`` and ``b/x.h`` keep distinct names, so two
    same-named files swapping contents change the fingerprint.
    """
    builder = KeyBuilder("kernelcache.fingerprint.files")
    listed = [os.fspath(path) for path in paths]
    absolute = [os.path.dirname(os.path.normpath(p)) for p in listed if os.path.isabs(p)]
    common = os.path.commonpath(absolute) if absolute else None
    base = os.fspath(root) if root is not None else common
    entries = [(_name(path, base, root is not None), _content_digest(path)) for path in listed]
    for name, digest in sorted(entries):
        builder.add(name, digest)
    return builder.hexdigest()


def _name(path: str, base: str | None, rooted: bool) -> str:
    """``path`` relative to ``base`` with ``/`` separators (see :func:`files`)."""
    if base is not None and (rooted or os.path.isabs(path)):
        # A plain prefix cut where it is exact: relpath costs ~10 us a file, and
        # TileLang's header trees have ~1,200 of them (issue 23).
        prefix = base.rstrip(os.sep) + os.sep
        if (
            path.startswith(prefix)
            and os.path.normpath(path) == path
            and base == os.path.normpath(base)
        ):
            name = path[len(prefix) :]
        else:
            name = os.path.relpath(path, base)
    else:
        name = os.path.normpath(path)
    return name.replace(os.sep, "/")


def _content_digest(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def env(names: Iterable[str]) -> str:
    """Fingerprint the values of chosen environment variables (unset differs from empty)."""
    builder = KeyBuilder("kernelcache.fingerprint.env")
    for name in sorted(set(names)):
        builder.add(name, os.environ.get(name))
    return builder.hexdigest()
