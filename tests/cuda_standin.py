"""A CUDA toolkit folder whose nvcc counts its runs, and a stub libcuda: for GPU-free DSL tests.

TileLang derives CUDA_HOME from the nvcc on PATH and runs ``$CUDA_HOME/bin/nvcc``;
ninetoothed runs ``nvcc`` from PATH. So the stand-in is a folder laid out like
the real toolkit: ``bin/nvcc`` is a wrapper script that appends one line per
run to ``$NVCC_COUNT_LOG`` and execs the real nvcc; every other entry is a
symlink to the real toolkit. The log path comes from the environment, not the
script text, so the wrapper's content (part of nvcc's identity in keys) is
the same in every test. Compiles stay real.

``-lcuda`` links need a libcuda, and loading what they built needs its symbols
(ctypes loads with RTLD_NOW). Without a driver, a stub built here with the host
compiler stands in: every driver entry point TileLang's and ninetoothed's
generated libraries call, each returning CUDA_ERROR_NO_DEVICE, as ``libcuda.so``
on LIBRARY_PATH and LD_LIBRARY_PATH. Nothing is launched through it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

WRAPPER = """#!/bin/sh
echo "$$ $*" >> "${{NVCC_COUNT_LOG:-/dev/null}}"
exec {real} "$@"
"""


# Driver entry points referenced by TileLang's (cython, tvm_ffi) and ninetoothed's
# (AOT) generated libraries with CUDA 13.0 (nm -D --undefined-only).
DRIVER_SYMBOLS = [
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxGetId",
    "cuCtxGetLimit",
    "cuCtxResetPersistingL2Cache",
    "cuCtxSetCurrent",
    "cuCtxSetLimit",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuFuncGetAttribute",
    "cuFuncSetAttribute",
    "cuFuncSetCacheConfig",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuMemsetD32_v2",
    "cuModuleGetFunction",
    "cuModuleGetGlobal_v2",
    "cuModuleLoadData",
    "cuModuleLoadDataEx",
    "cuModuleUnload",
    "cuOccupancyMaxActiveClusters",
    "cuPointerGetAttribute",
    "cuStreamGetCtx",
    "cuStreamSetAttribute",
    "cuTensorMapEncodeIm2col",
    "cuTensorMapEncodeTiled",
]


def build_libcuda_stub(folder: Path) -> Path:
    """``folder/libcuda.so``: every symbol of DRIVER_SYMBOLS, returning CUDA_ERROR_NO_DEVICE."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "libcuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 100; }}\n" for name in DRIVER_SYMBOLS))
    library = folder / "libcuda.so"
    compiler = shutil.which("gcc") or shutil.which("cc") or "cc"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so", "-o", str(library), str(source)],
        check=True,
    )
    return library


def real_toolkit() -> Path | None:
    """The installed CUDA toolkit whose ``bin/nvcc`` is the compiler itself (not a wrapper)."""
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for candidate in candidates:
        if not candidate:
            continue
        binary = Path(candidate) / "bin" / "nvcc"
        if binary.is_file() and binary.read_bytes()[:4] == b"\x7fELF":
            return Path(os.path.realpath(candidate))
    return None


@dataclass
class Toolkit:
    root: Path
    log: Path
    stub_dir: Path | None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose nvcc, CUDA_HOME and libcuda are the stand-ins."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["CUDA_HOME"] = str(self.root)
        env["NVCC_COUNT_LOG"] = str(self.log)
        if self.stub_dir is not None:
            for name in ("LIBRARY_PATH", "LD_LIBRARY_PATH"):
                env[name] = os.pathsep.join(filter(None, [str(self.stub_dir), env.get(name)]))
        return env

    def runs(self) -> list[str]:
        """Every nvcc command line run so far (``--version`` probes included)."""
        if not self.log.exists():
            return []
        return [
            line.split(" ", 1)[1] if " " in line else ""
            for line in self.log.read_text().splitlines()
        ]

    def compiles(self) -> list[str]:
        """The nvcc runs that compiled something (not ``--version`` probes, nor the
        ``--dryrun`` that asks nvcc which preprocessor runs a compile makes)."""
        return [
            args
            for args in self.runs()
            if args.strip() != "--version" and "--dryrun" not in args.split()
        ]

    def reset(self) -> None:
        self.log.unlink(missing_ok=True)


def make_toolkit(folder: Path, libcuda_stub: bool = True) -> Toolkit:
    """Build the stand-in toolkit under ``folder`` (see the module docstring)."""
    real = real_toolkit()
    if real is None:
        raise FileNotFoundError(
            "no CUDA toolkit with a real bin/nvcc found (CUDA_HOME, /usr/local/cuda, PATH)"
        )
    root = folder / "cuda"
    (root / "bin").mkdir(parents=True)
    for item in real.iterdir():
        if item.name != "bin":
            (root / item.name).symlink_to(item)
    for item in (real / "bin").iterdir():
        if item.name != "nvcc":
            (root / "bin" / item.name).symlink_to(item)
    wrapper = root / "bin" / "nvcc"
    wrapper.write_text(WRAPPER.format(real=real / "bin" / "nvcc"))
    wrapper.chmod(0o755)
    stub_dir = build_libcuda_stub(folder / "stubs").parent if libcuda_stub else None
    # kernelcache memoises compiler identities only for files older than 2 s (a
    # younger one may still change unseen): wait, so every test process after the
    # first finds nvcc's identity memoised and runs no `nvcc --version`.
    age = time.time() - max(wrapper.stat().st_mtime, wrapper.stat().st_ctime)
    time.sleep(max(0.0, 2.2 - age))
    return Toolkit(root=root, log=folder / "nvcc.log", stub_dir=stub_dir)
