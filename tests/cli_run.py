"""The ``kernelcache`` command line run as a user runs it: a subprocess, this checkout's code,
an environment free of the caller's ``KERNELCACHE_*`` but for what the test gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")


def kc(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m kernelcache ARGS`` with ``env`` over a clean environment."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCACHE_")}
    full.update(PYTHONPATH=SRC, **env)
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", *args],
        env=full, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def kc_json(*args: str, env: dict[str, str]) -> Any:
    """``kc(*args, "--json")``, which must succeed, parsed."""
    out = kc(*args, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
