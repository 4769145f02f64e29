"""``kernelcache explain --last-miss`` for Triton and JAX, whose keys hold the tool's own hash:
the parts that hash was made of are noted with each entry, so one real change is named by its
field, and only that field (issue 38)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from cli_run import kc_json


def _only_difference(kc_dir: Path, kind: str) -> dict[str, Any]:
    report: dict[str, Any] = kc_json(
        "explain", "--last-miss", kind, env={"KERNELCACHE_DIR": str(kc_dir)}
    )
    assert report["status"] == "miss", report
    near = report["nearest"][0]
    assert near["differing"] == 1, near
    difference: dict[str, Any] = near["differences"][0]
    return difference


# Triton ------------------------------------------------------------------------------------


def test_triton_last_miss_names_the_option_that_changed(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from test_triton import _finish, _kc_env, _start

    kc_dir = tmp_path / "kc"
    for warps in (4, 8):
        env = _kc_env(tmp_path, kc_dir, KC_TEST_TRITON_OPTIONS=json.dumps({"num_warps": warps}))
        assert _finish(_start(env, ["add"]))["add"]["cache_hit"] is False
    difference = _only_difference(kc_dir, "triton")
    assert difference["label"] == "options.num_warps"
    assert difference["words"] == "`options.num_warps`: 4 → 8"


def test_triton_parts_are_noted_only_from_the_compile_that_made_the_hash() -> None:
    pytest.importorskip("triton")
    from kernelcache.triton.explain import compile_parts

    assert compile_parts("A" * 52, inspect.currentframe()) is None  # no triton.compile below
