"""Reversible attribute patches: how the DSL integrations hook into packages that offer no hook.

TileLang and ninetoothed have no plug-in interface for their caches, so
:mod:`kernelcache.tilelang` and :mod:`kernelcache.ninetoothed` replace a few
named attributes (an instance's method, a class's classmethod, a module's
function). Each integration lists the upstream names it replaces in one table,
next to the package versions they were read from; this module applies such
patches and undoes them exactly: an attribute that was inherited (absent from
the object's own ``__dict__``) is deleted again, not set to the inherited value.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Patches"]

_ABSENT = object()


class Patches:
    """A stack of ``setattr`` calls that :meth:`restore` undoes in reverse order.

    Thread-safe; patching the same attribute twice keeps the first original,
    so restoring always returns to the state before the first patch.
    """

    def __init__(self) -> None:
        # (object, name, what the object itself held or _ABSENT), or (undo, "", None)
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering what ``obj`` itself held before."""
        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT
        with self._lock:
            if not any(o is obj and n == name for o, n, _ in self._saved):
                self._saved.append((obj, name, own))
        setattr(obj, name, value)

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Call ``undo()`` in :meth:`restore`, in its place among the patches (for state that
        is not a plain attribute: torch's config entries, derived objects)."""
        with self._lock:
            self._saved.append((undo, "", None))

    def setenv(self, name: str, value: str) -> None:
        """``os.environ[name] = value``; :meth:`restore` puts back the value or the absence."""
        before = os.environ.get(name)

        def undo() -> None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

        self.on_restore(undo)
        os.environ[name] = value

    def restore(self) -> None:
        """Undo every patch, newest first."""
        with self._lock:
            saved, self._saved = self._saved, []
        for obj, name, own in reversed(saved):
            if not name:
                obj()
            elif own is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, own)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._saved)
