"""A small header tree standing in for TileLang's, for the memo and manifest tests."""

from __future__ import annotations

from pathlib import Path

import pytest


def header_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``<tmp>/headers`` (``top.h`` including ``cuda/common.h``), with a writable cache
    directory of its own (``KERNELCACHE_DIR``)."""
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.delenv("KERNELCACHE_READONLY", raising=False)
    folder = tmp_path / "headers"
    (folder / "cuda").mkdir(parents=True)
    (folder / "cuda" / "common.h").write_text("#define A 1\n")
    (folder / "top.h").write_text('#include "cuda/common.h"\n')
    return folder
