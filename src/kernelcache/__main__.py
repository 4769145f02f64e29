"""``kernelcache`` command line; a thin layer over the public API (see cli/).

``python -m kernelcache`` and the ``kernelcache-cli`` console script start
here. The ``kernelcache`` executable itself is :mod:`kernelcache.nvcc.client`
run as a script, which comes here for everything but a launcher call.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # The compiler launcher is on every build's critical path: skip argparse and
    # the CLI for it. CMake calls ``kernelcache /path/to/nvcc ...``.
    if args and (args[0] == "nvcc" or args[0].endswith(("/nvcc", "/nvcc.exe"))):
        from kernelcache.nvcc.front import main as nvcc_main

        return int(nvcc_main(args))
    from kernelcache.cli import main as cli_main

    return int(cli_main(args))


if __name__ == "__main__":
    sys.exit(main())
