"""An nvcc that DeepGEMM accepts as ``DG_JIT_NVCC_COMPILER``: the launcher in front of the real one.

DeepGEMM runs the file that variable names, first as ``<file> --version`` (it
reads the release, 12.3 or later, from the answer), then once per kernel as
``<file> <cache>/tmp/<uuid>/kernel.cu -cubin -o ...``. The shim is a two-line
``sh`` script that runs ``kernelcache <nvcc> "$@"``: ``--version`` is not a
compile, so the launcher hands it to nvcc unchanged and the answer is nvcc's own.
Made by ``kernelcache setup deepgemm`` (or :func:`install`) as
``<cache dir>/bin/deepgemm-nvcc``, written whole and renamed into place, so a
rank reading it while another rewrites it sees one or the other.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
from collections.abc import Mapping

from kernelcache import _fs, _trust

NAME = "deepgemm-nvcc"


def front(env: Mapping[str, str] | None = None) -> str:
    """The ``kernelcache`` command of this installation (beside this interpreter, else on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "kernelcache")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("kernelcache", path=(env or os.environ).get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(
            "no `kernelcache` command beside this Python nor on PATH: install kernelcache with pip"
        )
    return os.path.abspath(found)


def real_nvcc(env: Mapping[str, str] | None = None) -> str:
    """The nvcc behind the shim: ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on PATH."""
    env = os.environ if env is None else env
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError("no nvcc: set CUDA_HOME, put nvcc on PATH, or pass --nvcc")
    return os.path.abspath(found)


def text(launcher: str, nvcc: str) -> str:
    return (
        "#!/bin/sh\n"
        "# DeepGEMM's DG_JIT_NVCC_COMPILER through the kernelcache launcher"
        " (kernelcache setup deepgemm).\n"
        f'exec {shlex.quote(launcher)} {shlex.quote(nvcc)} "$@"\n'
    )


def install(directory: str, nvcc: str | None = None, launcher: str | None = None) -> str:
    """Write the shim under ``directory/bin`` (the cache directory) and return its path."""
    if nvcc is not None and not (os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)):
        raise FileNotFoundError(f"--nvcc {nvcc}: not an executable file")
    nvcc = os.path.abspath(nvcc) if nvcc is not None else real_nvcc()
    launcher = launcher or front()
    folder = os.path.join(directory, "bin")
    path = os.path.join(folder, NAME)
    wanted = text(launcher, nvcc).encode()
    # A program every rank will run: only from a directory trusted as this user's own
    # (UntrustedDirectory otherwise), read and written through its checked descriptor.
    fd = _trust.open_dir(folder, allow_root=False, create=True)
    if fd is None:  # create=True: made, or raised
        raise FileNotFoundError(f"cannot make {folder}")
    try:
        try:
            existing = _trust.open_file(fd, NAME, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            existing = None
        if existing is not None:
            with os.fdopen(existing, "rb") as f:
                if stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read() == wanted:
                    return path  # unchanged: every rank of a server may ask at once
        _fs.write_atomic(NAME, wanted, mode=0o755, dir_fd=fd)
    finally:
        os.close(fd)
    return path
