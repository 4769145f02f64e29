"""``kernelcache nvcc ARGS...``: a caching compiler launcher for nvcc, like ccache.

The control flow, direct key and hit are in ``launcher.py``; the command line
in ``args.py``, dependency files and manifests in ``deps.py``, what a hit
writes in ``outputs.py`` and the miss in ``miss.py``.
"""

from __future__ import annotations

from kernelcache.nvcc.launcher import (
    ENV_VARS,
    STATS_FILE,
    direct_key,
    forget,
    host_compiler,
    launcher_stats,
    main,
    stats_path,
)

__all__ = [
    "ENV_VARS",
    "STATS_FILE",
    "direct_key",
    "forget",
    "host_compiler",
    "launcher_stats",
    "main",
    "stats_path",
]
