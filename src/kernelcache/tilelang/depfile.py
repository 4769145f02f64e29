"""What a TileLang compile read, written by the compile's own device preprocessor run.

A header manifest (:mod:`kernelcache.tilelang.manifest`) lists the files the
compile read. Asking nvcc's device preprocessor again with ``-M``
(:func:`kernelcache.tilelang.recording.discover`) costs ~0.2 s of CPU per
miss: free beside a lone compile on an idle core, 7 % more time when every
core compiles, as in an autotuning sweep (issue 23). nvcc hands
``-Xcompiler`` flags to the host compiler it runs as that preprocessor
(``gcc -E -D__CUDA_ARCH__=900 ...``), and GCC's ``-MD -MF FILE`` makes the run
write what it read as a side effect, as ccache's depend mode has the compiler
do. Checked with nvcc 13.0: the cubin is byte-identical with and without the
flags, and the file lists what the ``-M`` run lists
(``tests/test_tilelang_manifest.py``).

Only where exactly one run writes the file: ``--cubin`` and ``--ptx`` compile
one device architecture and no host code (a ``--fatbin`` may preprocess once
per architecture, each run overwriting the file). The host compiler must be
GCC or Clang, which take the flags, and neither the call nor
``NVCC_PREPEND_FLAGS``/``NVCC_APPEND_FLAGS`` may ask for dependencies or add
architectures. Elsewhere, or when no file was written, the recording runs the
preprocessor as before.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from kernelcache import _fs
from kernelcache.entry import private_dir
from kernelcache.nvcc import deps

#: nvcc output formats that preprocess the device code once and compile no host code.
FORMATS = ("cubin", "ptx")
# GCC and Clang drivers as installed: g++, x86_64-linux-gnu-g++-12, clang++-17, cc.
_GCC_LIKE = re.compile(r"(?:[\w.]+-)*(?:g\+\+|gcc|c\+\+|cc|clang\+\+|clang)(?:-[\d.]+)?")

# Options that name device architectures; the call's own come in its ``arch`` argument.
_MORE_TARGETS = (
    "-arch",
    "--gpu-architecture",
    "-gencode",
    "--generate-code",
    "-code",
    "--gpu-code",
)


def flags(
    target_format: str, options: list[str], host: str | None, env: Mapping[str, str]
) -> tuple[list[str], str] | None:
    """Options to add to the compile, and the file its preprocessor run will write;
    ``None`` where that run is not known to write it alone (see the module docstring).
    ``host``: the host compiler nvcc runs (``-ccbin``); ``env``: nvcc's environment."""
    if os.name != "posix" or target_format not in FORMATS:
        return None
    # nvcc takes more options from the environment, before and after the command line's.
    variables = (env.get(name, "") for name in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"))
    given = [*options, *(token.strip("'\"") for text in variables for token in text.split())]
    if any("-M" in option or "dependenc" in option for option in given):
        return None  # the call asks for dependencies itself: nvcc's pass would write there too
    if any(option.startswith(_MORE_TARGETS) for option in given):
        return None  # architectures beside the call's own: more than one device run
    if not host or not _GCC_LIKE.fullmatch(os.path.basename(host)):
        return None
    # A compile that fails leaves its file there; nothing else reads it.
    path = os.path.join(private_dir(), _fs.unique() + ".d")
    if "," in path or any(c.isspace() for c in path):
        return None  # nvcc splits -Xcompiler at commas; a space would need quoting
    return ["-Xcompiler", f"-MD,-MF,{path}"], path


def read(path: str) -> list[str] | None:
    """The files the compile's preprocessor run read (the file is removed);
    ``None`` when it wrote no usable file."""
    try:
        with open(path, "rb") as f:
            text = f.read()
        os.unlink(path)
    except FileNotFoundError:
        return None
    try:
        return deps.parse_depfile(text)[1]
    except ValueError:
        return None
