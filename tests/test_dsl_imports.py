"""The DSL integrations without their package: an ImportError that names the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("module", "package"), [("tilelang", "tilelang"), ("ninetoothed", "ninetoothed")]
)
def test_missing_package_names_the_extra(module: str, package: str) -> None:
    code = (
        "import sys\n"
        f"sys.modules[{package!r}] = None  # as if it were not installed\n"
        f"import kernelcache.{module}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError"), proc.stderr
    assert f"kernelcache[{module}]" in last, proc.stderr


def test_core_imports_no_integration() -> None:
    code = (
        "import sys, kernelcache\n"
        "from kernelcache import Cache, Entry, KeyBuilder, toolchain, fingerprint\n"
        "import kernelcache.autotune, kernelcache.memoize, kernelcache.cache\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'ninetoothed', 'tvm')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
