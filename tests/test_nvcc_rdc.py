"""Relocatable device code from a cold miss links as plain nvcc's does.

A cold miss compiles with ``--keep`` into a temporary directory (its
preprocessed key comes from the kept files), so the object names its host
source ``k.cudafe1.cpp`` where plain nvcc writes ``tmpxft_<pid>_..._k.cudafe1.cpp``.
Device linking relies on names nvcc derives from the *source path*
(``--orig_src_path_name``): the module id in ``__fatbinwrap_*``,
``__cudaRegisterLinkedBinary_*`` and the internal names of anonymous-namespace
and ``static`` device symbols. Two translation units with the same base name
in different folders, each with same-named internal device symbols, must
therefore keep distinct module ids and device-link to what plain nvcc gives.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kernelcache.nvcc.launcher import launcher_stats, main
from launcher_env import without_file_symbol

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

UNIT = """namespace {{ __device__ int hidden = {n}; __device__ int helper(int x) {{ return x + hidden; }} }}
static __device__ int twice(int x) {{ return 2 * x; }}
__device__ int {name}_value = {n};
__device__ int {name}_fn(int x) {{ return helper(twice(x)) + {name}_value; }}
extern __device__ int {other}_fn(int);
__global__ void {name}_kernel(int* out) {{ *out = {name}_fn(1) + {other}_fn(2); }}
int launch_{name}(int* out) {{ {name}_kernel<<<1, 1>>>(out); return 0; }}
"""
MAIN = """int launch_a(int*); int launch_b(int*);
int main() { int* p = nullptr; cudaMalloc(&p, 4); launch_a(p); launch_b(p); return 0; }
"""
ARCH = "-arch=sm_90"


def _symbols(path: Path) -> list[str]:
    """Host symbols' types and names (addresses move with the size of -G's notes)."""
    out = subprocess.run(["nm", str(path)], capture_output=True, check=True, text=True).stdout
    return [" ".join(line.split()[-2:]) for line in out.splitlines()]


def _file_symbols(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, check=True, text=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if " FILE " in line]


def _link(objects: list[Path], out: Path) -> None:
    """Device-link (``-dlink``) and link an executable, as a build with ``-rdc`` does."""
    paths = [str(o) for o in objects]
    nvcc = ["nvcc", ARCH]
    subprocess.run([*nvcc, "-dlink", *paths, "-o", str(out / "dlink.o")], check=True)
    subprocess.run([*nvcc, *paths, "-o", str(out / "app")], check=True)


@pytest.mark.parametrize("mode", [["-rdc=true", "-c"], ["-dc", "-G"]], ids=["rdc-c", "dc-G"])
def test_same_named_units_device_link_as_plain_nvcc_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: list[str]
) -> None:
    root = tmp_path / "p"
    for folder, name, other, n in (("a", "a", "b", 1), ("b", "b", "a", 2)):
        (root / folder).mkdir(parents=True)
        (root / folder / "k.cu").write_text(UNIT.format(name=name, other=other, n=n))
    (root / "main.cu").write_text(MAIN)
    time.sleep(0.05)  # older than the compiles' start (RACE_SLOP_NS)
    monkeypatch.chdir(root)
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    for name in ("KERNELCACHE_BASEDIR", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN"):
        monkeypatch.delenv(name, raising=False)
    subprocess.run(["nvcc", ARCH, "-rdc=true", "-c", "main.cu", "-o", "main.o"], check=True)
    outs = {"plain": root / "plain", "cold": root / "cold"}
    for out in outs.values():
        out.mkdir()
    before = launcher_stats().get("misses", 0)
    for unit in ("a", "b"):
        args = [ARCH, *mode, f"{unit}/k.cu", "-o"]
        subprocess.run(["nvcc", *args, str(outs["plain"] / f"{unit}.o")], check=True)
        assert main(["nvcc", *args, str(outs["cold"] / f"{unit}.o")]) == 0
    assert launcher_stats()["misses"] == before + 2
    # The cold misses took the --keep path (else this test compares nothing new).
    assert "k.cudafe1.cpp" in _file_symbols(outs["cold"] / "a.o")
    for out in outs.values():
        _link([out / "a.o", out / "b.o", root / "main.o"], out)

    plain, cold = outs["plain"], outs["cold"]
    wraps = [s for u in ("a", "b") for s in _symbols(cold / f"{u}.o") if "__fatbinwrap_" in s]
    assert len(set(wraps)) == 2  # same base name, distinct module ids
    for name in ("a.o", "b.o", "dlink.o", "app"):
        assert _symbols(cold / name) == _symbols(plain / name), name
    if "-G" not in mode:
        # -G records ptxas's command line, temporary file names included, in
        # .note.nv.tkinfo; without it only the host file symbol differs.
        for unit in ("a.o", "b.o"):
            assert without_file_symbol((cold / unit).read_bytes()) == without_file_symbol(
                (plain / unit).read_bytes()
            )
        assert (cold / "dlink.o").read_bytes() == (plain / "dlink.o").read_bytes()
