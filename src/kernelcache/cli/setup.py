"""``kernelcache setup deepgemm``: the compiler DeepGEMM runs (``DG_JIT_NVCC_COMPILER``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelcache.settings import Settings


def cmd_setup(args: argparse.Namespace, settings: Settings) -> int:
    from kernelcache.servers import shim

    path = shim.install(settings.dir, nvcc=args.nvcc)
    print(f"export DG_JIT_NVCC_COMPILER={path}")
    return 0
