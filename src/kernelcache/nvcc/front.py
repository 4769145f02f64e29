"""The launcher from an importing process (``python -m kernelcache nvcc``, ``kernelcache-cli nvcc``).

It asks the server first, as the standalone client does
(:func:`kernelcache.nvcc.client.serve`), and imports the launcher only when
the server gave no answer. Kept out of ``client.py``: that module runs without
the package (bin/kernelcache loads it alone) and must not depend on the
launcher, which depends on it (``nvcc.compiling``).
"""

from __future__ import annotations

import sys

from kernelcache.nvcc.client import serve


def main(argv: list[str]) -> int:
    """Run ``argv`` (``nvcc ARGS...``) through the server, else the launcher in this process."""

    def local(args: list[str]) -> int:
        from kernelcache.nvcc.launcher import main as launch

        return launch(args)

    def plain(nvcc: str, args: list[str]) -> int:
        from kernelcache.nvcc.launcher import run_plain

        return run_plain(nvcc, args)

    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what this process printed before comes first
    return serve(argv, local, plain)
