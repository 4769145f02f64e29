"""What a launcher hit writes: the output, the dependency file, nvcc's messages.

Each file is written atomically and byte-identical to what nvcc wrote on the
miss; the dependency file gets this call's target (``-o``, or the object name
nvcc picks) unless the compile named one (``-MT``). nvcc's stdout and stderr
are replayed by the caller (the server hands them to its client).

An output of at least :data:`COMPRESS_MIN` bytes is stored as one zstd frame
when that saves at least a fifth (objects and fatbins of real kernels shrink
2-5x; ccache compresses too), if ``zstandard`` is installed (the ``redis``
extra). Its size is in the result's meta, and decompression is bounded by it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kernelcache import _fs
from kernelcache.nvcc import deps as nvcc_deps

if TYPE_CHECKING:
    from kernelcache.entry import Entry
    from kernelcache.nvcc.args import Invocation


COMPRESS_MIN = 64 << 10
COMPRESS_LEVEL = 3


def pack_output(data: bytes) -> tuple[bytes, dict[str, object]]:
    """``(stored bytes, meta)`` of an output: zstd when it pays, else the bytes as they are."""
    if len(data) < COMPRESS_MIN:
        return data, {}
    try:
        import zstandard
    except ImportError:
        return data, {}
    frame = zstandard.ZstdCompressor(level=COMPRESS_LEVEL).compress(data)
    if len(frame) > len(data) * 4 // 5:
        return data, {}
    return frame, {"output_codec": "zstd", "output_size": len(data)}


def unpack_output(result: Entry) -> bytes:
    """The output as nvcc wrote it; ``ValueError`` for a frame that does not decode to its size."""
    stored = result["output"]
    codec = result.meta.get("output_codec")
    if codec is None:
        return stored
    size = result.meta.get("output_size")
    if codec != "zstd" or not isinstance(size, int) or size < 0:
        raise ValueError(f"unknown output encoding {codec!r}")
    import zstandard

    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"damaged zstd output: {exc}") from exc
    if len(data) != size:
        raise ValueError("zstd output of the wrong size")
    return bytes(data)


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
        output = unpack_output(result)
        _fs.write_atomic(inv.output or "", output, mode=0o666, unlink_first=True)
        if depfile is not None:
            _fs.write_atomic(inv.depfile or "", depfile, mode=0o666, unlink_first=True)
    except (OSError, KeyError, ValueError, ImportError):
        return False  # nvcc then runs, as on a miss
    return True


#: The result's meta flag: its stdout and stderr name the source's folder as a token
#: (a result shared across folders, :func:`kernelcache.nvcc.key.portable_folder`).
MESSAGES_META = "messages_in_folder"


def stored_messages(stdout: bytes, stderr: bytes, folder: str | None) -> tuple[bytes, bytes]:
    """nvcc's messages as a result shared across folders stores them: ``folder`` as a token."""
    if folder is None:
        return stdout, stderr
    return nvcc_deps.to_stored(stdout, folder), nvcc_deps.to_stored(stderr, folder)


def messages(result: Entry, basedir: str | None) -> tuple[bytes, bytes]:
    """nvcc's stdout and stderr as a hit replays them: naming this call's folder."""
    stdout, stderr = result["stdout"], result["stderr"]
    if not result.meta.get(MESSAGES_META) or not basedir:
        return stdout, stderr
    return nvcc_deps.from_stored(stdout, basedir), nvcc_deps.from_stored(stderr, basedir)


def replay(stdout: bytes, stderr: bytes) -> None:
    for stream, data in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if data:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()
