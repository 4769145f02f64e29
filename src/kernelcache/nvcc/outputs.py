"""What a launcher hit writes: the output, the dependency file, nvcc's messages.

Each file is written atomically and byte-identical to what nvcc wrote on the
miss; the dependency file gets this call's target (``-o``, or the object name
nvcc picks) unless the compile named one (``-MT``). nvcc's stdout and stderr
are replayed by the caller (the server hands them to its client).
"""

from __future__ import annotations

import os
import sys

from kernelcache import _fs
from kernelcache.nvcc import deps as nvcc_deps

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from kernelcache.entry import Entry
    from kernelcache.nvcc.args import Invocation


def write_outputs(inv: Invocation, result: Entry, basedir: str | None) -> bool:
    """Write the cached outputs; ``False`` (nvcc then runs) if they cannot be written."""
    try:
        depfile = None
        if inv.depfile is not None:
            depfile = nvcc_deps.from_stored(result["depfile"], basedir)
            if not result.meta.get("explicit_target"):
                depfile = os.fsencode(inv.target) + depfile
        # Written whole and renamed into place: make trusts mtimes. The old file
        # goes first (no ext4 flush on rename), and the mode is nvcc's (umask).
        _fs.write_atomic(inv.output or "", result["output"], mode=0o666, unlink_first=True)
        if depfile is not None:
            _fs.write_atomic(inv.depfile or "", depfile, mode=0o666, unlink_first=True)
    except (OSError, KeyError, ValueError):
        return False
    return True


def replay(stdout: bytes, stderr: bytes) -> None:
    for stream, data in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if data:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()
