"""vLLM's plugin and DeepGEMM's compiler shim (issue 37), as vLLM and DeepGEMM call them.

vLLM is not installed here: a fresh interpreter does what vLLM's
``load_general_plugins`` does (every ``vllm.general_plugins`` entry point loaded
and called with no arguments) with logging set up as vLLM sets it, and prints
the environment the plugin left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernelcache.cli.main import main as cli
from kernelcache.servers import shim

AS_VLLM = """
import json, logging, os, sys
from importlib.metadata import entry_points
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
for plugin in entry_points(group="vllm.general_plugins"):
    plugin.load()()
    plugin.load()()  # vLLM may load plugins again in one process: said once
names = ("FLASHINFER_NVCC_LAUNCHER", "DG_JIT_NVCC_COMPILER", "PYTORCH_NVCC",
         "TRITON_CACHE_MANAGER", "KERNELCACHE_INDUCTOR")
print(json.dumps({n: os.environ.get(n) for n in names}))
"""
VARIABLES = (
    "FLASHINFER_NVCC_LAUNCHER",
    "DG_JIT_NVCC_COMPILER",
    "PYTORCH_NVCC",
    "TRITON_CACHE_MANAGER",
    "KERNELCACHE_INDUCTOR",
)


def as_vllm(tmp_path: Path, **extra: str) -> tuple[dict[str, str | None], list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "KERNELCACHE_VLLM"}
    env.update(KERNELCACHE_DIR=str(tmp_path / "cache"), **extra)
    done = subprocess.run(
        [sys.executable, "-c", AS_VLLM], env=env, capture_output=True, text=True, check=True
    )
    *logged, last = done.stdout.strip().splitlines()
    found: dict[str, str | None] = json.loads(last)
    return found, [line for line in logged if "kernelcache" in line]


def test_the_plugin_does_nothing_unless_asked(tmp_path: Path) -> None:
    found, logged = as_vllm(tmp_path)
    assert found == dict.fromkeys(VARIABLES)
    assert logged == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_plugin_sets_every_launcher_once_and_says_so(tmp_path: Path) -> None:
    found, logged = as_vllm(tmp_path, KERNELCACHE_VLLM="1")
    front = str(Path(sys.executable).parent / "kernelcache")
    assert found["FLASHINFER_NVCC_LAUNCHER"] == front
    assert found["TRITON_CACHE_MANAGER"] == "kernelcache.triton:CacheManager"
    assert found["KERNELCACHE_INDUCTOR"] == "1"
    assert (found["PYTORCH_NVCC"] or "").startswith(front + " ")
    compiler = found["DG_JIT_NVCC_COMPILER"]
    assert compiler == str(tmp_path / "cache" / "bin" / shim.NAME)
    # DeepGEMM's check: `<compiler> --version` answers as the nvcc behind it.
    nvcc = (found["PYTORCH_NVCC"] or "").split(" ", 1)[1]
    theirs = subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout
    assert theirs == subprocess.run([nvcc, "--version"], capture_output=True, check=True).stdout
    assert b"release" in theirs
    assert len(logged) == 1
    assert logged[0].startswith("vllm.plugins.kernelcache ")
    assert "FLASHINFER_NVCC_LAUNCHER" in logged[0]


def test_what_the_user_set_stays(tmp_path: Path) -> None:
    found, logged = as_vllm(
        tmp_path,
        KERNELCACHE_VLLM="1",
        FLASHINFER_NVCC_LAUNCHER="sccache",
        DG_JIT_NVCC_COMPILER="/x",
    )
    assert (found["FLASHINFER_NVCC_LAUNCHER"], found["DG_JIT_NVCC_COMPILER"]) == ("sccache", "/x")
    assert not (tmp_path / "cache" / "bin" / shim.NAME).exists()
    assert len(logged) == 1


def test_a_slip_in_the_opt_in_is_one_line(tmp_path: Path) -> None:
    found, logged = as_vllm(tmp_path, KERNELCACHE_VLLM="yes please")
    assert found == dict.fromkeys(VARIABLES)
    assert len(logged) == 1
    assert "neither 0 nor 1" in logged[0]


def test_setup_deepgemm_writes_the_shim_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V12.9.86'\n")
    fake.chmod(0o755)
    assert cli(["setup", "deepgemm", "--dir", str(tmp_path / "c"), "--nvcc", str(fake)]) == 0
    path = tmp_path / "c" / "bin" / shim.NAME
    assert capsys.readouterr().out == f"export DG_JIT_NVCC_COMPILER={path}\n"
    before = path.stat()
    assert shim.install(str(tmp_path / "c"), str(fake)) == str(path)
    assert path.stat().st_ino == before.st_ino  # unchanged: not rewritten
    out = subprocess.run([str(path), "--version"], capture_output=True, check=True).stdout
    assert b"release 12.9" in out
    assert cli(["setup", "deepgemm", "--dir", str(tmp_path / "c"), "--nvcc", "/no/nvcc"]) == 1
    assert "--nvcc /no/nvcc: not an executable file" in capsys.readouterr().err


def test_the_shim_is_never_written_where_others_could_change_it(tmp_path: Path) -> None:
    # Every vLLM rank runs it: a cache directory writable by others gets no shim (review).
    from kernelcache._trust import UntrustedDirectory

    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UntrustedDirectory):
        shim.install(str(shared / "c"), str(fake))
    assert not (shared / "c").exists()


def test_without_nvcc_the_shim_says_how_to_fix_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="set CUDA_HOME"):
        shim.real_nvcc({"PATH": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="install kernelcache"):
        _front_elsewhere(tmp_path)


def _front_elsewhere(tmp_path: Path) -> str:
    """:func:`shim.front` from an interpreter with no ``kernelcache`` beside it."""
    saved = sys.executable
    sys.executable = str(tmp_path / "python")
    try:
        return shim.front({"PATH": str(tmp_path)})
    finally:
        sys.executable = saved


def test_without_nvcc_the_plugin_says_what_it_could_not_set(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "CUDA_HOME": "", "CUDA_PATH": ""}
    found, logged = as_vllm(tmp_path, KERNELCACHE_VLLM="1", **env)
    assert found["TRITON_CACHE_MANAGER"] == "kernelcache.triton:CacheManager"
    assert (found["FLASHINFER_NVCC_LAUNCHER"], found["DG_JIT_NVCC_COMPILER"]) == (None, None)
    assert len(logged) == 1
    assert "not set: FLASHINFER_NVCC_LAUNCHER, DG_JIT_NVCC_COMPILER, PYTORCH_NVCC" in logged[0]
    assert "set CUDA_HOME" in logged[0]
