"""``KERNELCACHE_JAX=1``: :func:`kernelcache.jax.install` when JAX sets up its backends.

For jobs whose script cannot change. JAX imports every module named in the
``jax_plugins`` entry-point group and calls its ``initialize()`` before its
first compile (``jax._src.xla_bridge.discover_pjrt_plugins``, JAX 0.6 to
0.10); kernelcache registers this module there (pyproject.toml). With the
variable unset it costs one dictionary lookup, which is why it lives outside
the :mod:`kernelcache.jax` package.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "KERNELCACHE_JAX"


def initialize() -> None:
    value = os.environ.get(VARIABLE, "")
    if value in ("", "0"):
        return
    if value != "1":
        # A slip is one line, never a failed JAX start.
        print(
            f"kernelcache: {VARIABLE}={value!r} is neither 0 nor 1: JAX keeps its own cache",
            file=sys.stderr,
        )
        return
    import kernelcache.jax
    from kernelcache.errors import ConfigError

    try:
        kernelcache.jax.install()
    except ConfigError as exc:
        # JAX would log it as a plugin's traceback and go on: one line says the same.
        print(f"kernelcache: {exc}: JAX keeps its own cache", file=sys.stderr)
