"""After the quick start a new user has a command that works (issue 20, item 8)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bootstrap_says_which_command_to_use_when_path_does_not_find_it() -> None:
    if not (ROOT / ".venv" / ".kernelcache-installed").exists():
        pytest.skip("no bootstrapped .venv in this checkout")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", "scripts/bootstrap.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    command = f"{ROOT.resolve()}/.venv/bin/kernelcache"
    assert f"the command is {command}" in out.stderr
    assert os.access(command, os.X_OK)
    version = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("kernelcache ")


def test_the_readme_cmake_line_names_a_command_that_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    launchers = re.findall(r"CMAKE_CUDA_COMPILER_LAUNCHER=(\S+)", readme)
    assert launchers
    for launcher in launchers:
        assert launcher.endswith(".venv/bin/kernelcache"), launcher  # never a bare name
