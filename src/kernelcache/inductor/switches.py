"""torch config switches turned on while installed, and restored exactly.

torch's config modules (``torch.utils._config_module``) tell a switch the
user never set from one set to the same value: ``_is_default`` and the saved
config differ. Setting the old value back would leave it
"set", so :func:`switch_on` remembers whether it was set at all and, if not,
deletes the override again (``delattr``), which torch supports for
``unittest.mock.patch``. That also hides the name until the next set (a
workaround for mock, python/cpython#126886), so the entry is shown again.
"""

from __future__ import annotations

from contextvars import ContextVar
from types import ModuleType
from typing import Any

from torch.utils._config_module import _UNSET_SENTINEL  # a seam: kernelcache.inductor.SEAMS

from kernelcache.patching import Patches


def user_override(entry: Any) -> object:
    """What the user set a switch to, or ``_UNSET_SENTINEL``.

    Two shapes of torch's per-switch record (``_ConfigEntry.user_override``):
    a ``ContextVar`` (torch 2.13 on: a value per context), or the value itself
    (2.10 to 2.12).
    """
    held = entry.user_override
    return held.get() if isinstance(held, ContextVar) else held


def switch_on(patches: Patches, config: ModuleType, name: str) -> None:
    """``config.<name> = True`` until ``patches.restore()`` puts back exactly what was."""
    entry = config._config[name]  # noqa: SLF001  (torch's per-switch record)
    before = user_override(entry)

    def undo() -> None:
        if before is _UNSET_SENTINEL:
            delattr(config, name)
            entry.hide = False
        else:
            setattr(config, name, before)

    setattr(config, name, True)
    patches.on_restore(undo)
