"""``KERNELCACHE_INDUCTOR=1``: :func:`kernelcache.inductor.install` at ``import torch``.

For jobs whose training script cannot change. ``import torch`` calls every
``torch.backends`` entry point (torch's device-extension autoload, on unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); kernelcache registers :func:`autoload`
there (pyproject.toml). With the variable unset it costs one dictionary
lookup, which is why it lives outside the :mod:`kernelcache.inductor` package.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "KERNELCACHE_INDUCTOR"


def autoload() -> None:
    value = os.environ.get(VARIABLE, "")
    if value in ("", "0"):
        return
    if value != "1":
        # A slip is one line, never a failed ``import torch``.
        print(
            f"kernelcache: {VARIABLE}={value!r} is neither 0 nor 1: torch.compile keeps its own caches",
            file=sys.stderr,
        )
        return
    import kernelcache.inductor

    kernelcache.inductor.install()
