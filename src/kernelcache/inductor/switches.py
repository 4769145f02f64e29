"""torch config switches turned on while installed, and restored exactly.

torch's config modules (``torch.utils._config_module``, 2.13.0) tell a
switch the user never set from one set to the same value: ``_is_default``
and the saved config differ. Setting the old value back would leave it
"set", so :func:`switch_on` remembers whether it was set at all and, if not,
deletes the override again (``delattr``), which torch supports for
``unittest.mock.patch``. That also hides the name until the next set (a
workaround for mock, python/cpython#126886), so the entry is shown again.
"""

from __future__ import annotations

from types import ModuleType

from torch.utils._config_module import _UNSET_SENTINEL  # a seam: kernelcache.inductor.SEAMS

from kernelcache.patching import Patches


def switch_on(patches: Patches, config: ModuleType, name: str) -> None:
    """``config.<name> = True`` until ``patches.restore()`` puts back exactly what was."""
    entry = config._config[name]  # noqa: SLF001  (torch's per-switch record)
    before = entry.user_override.get()

    def undo() -> None:
        if before is _UNSET_SENTINEL:
            delattr(config, name)
            entry.hide = False
        else:
            setattr(config, name, before)

    setattr(config, name, True)
    patches.on_restore(undo)
