"""The suite leaves the user's home untouched (issue 20, item 11): HOME and XDG_CACHE_HOME
point at a temporary directory for the whole run (tests/conftest.py), subprocesses too."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path

from kernelcache._dirs import cache_dir
from kernelcache.settings import default_dir


def test_home_and_the_default_cache_dir_are_temporary() -> None:
    real = pwd.getpwuid(os.getuid()).pw_dir
    home = os.environ["HOME"]
    assert os.path.realpath(home) != os.path.realpath(real)
    assert home.startswith(tempfile.gettempdir())
    assert Path(default_dir()).is_relative_to(home)
    env = {k: v for k, v in os.environ.items() if k != "KERNELCACHE_DIR"}
    assert Path(cache_dir(env)).is_relative_to(home)


def test_subprocesses_inherit_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KERNELCACHE_DIR"}
    code = "from kernelcache.settings import Settings; print(Settings.load().dir)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    assert Path(out.stdout.strip()).is_relative_to(os.environ["HOME"])
    assert not Path(out.stdout.strip()).is_relative_to(pwd.getpwuid(os.getuid()).pw_dir)
    assert os.path.expanduser("~") == os.environ["HOME"]
