"""A second local user for the trust tests (issue 19): a real uid, not a mock.

The tests run as root here; ``as_other`` runs a command as ``nobody``
(65534) through ``setpriv``, and ``shared_base`` is a directory both can
reach (pytest's own temporary directories are private to root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

OTHER = 65534
needs_other_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second user",
)


def as_other(*cmd: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    """Run ``cmd`` as the second user (its own uid and gid, no groups), checked."""
    setpriv = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"]
    return subprocess.run([*setpriv, *cmd], check=True, capture_output=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def others_dir(path: Path, mode: int = 0o755) -> Path:
    """A directory of the second user's, with ``mode`` (made here, then given away)."""
    path.mkdir()
    os.chown(path, OTHER, OTHER)
    os.chmod(path, mode)
    return path


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A root-owned 0755 directory under /tmp that the second user can reach."""
    base = Path(tempfile.mkdtemp(prefix="kc-trust-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
