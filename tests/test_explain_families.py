"""``kernelcache explain --last-miss`` for the DSL families, on real compiles: one change, and
the field that names it (issue 38). ninetoothed's AOT path runs nvcc for real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ninetoothed")
pytest.importorskip("triton")

import children
from cli_run import kc_json
from test_ninetoothed import SCRIPT, nt_env, toolkit  # noqa: F401  (fixtures)


def test_ninetoothed_last_miss_names_the_environment_variable(
    nt_env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    first = children.finish(children.start(SCRIPT, nt_env, "aot", str(tmp_path / "a")))
    assert first["stats"]["output_compiles"] == 1
    changed = {**nt_env, "CPATH": str(tmp_path)}  # an include path nvcc would search
    second = children.finish(children.start(SCRIPT, changed, "aot", str(tmp_path / "a")))
    assert second["stats"]["output_compiles"] == 1
    report: dict[str, Any] = kc_json(
        "explain", "--last-miss", "ninetoothed", env={"KERNELCACHE_DIR": nt_env["KERNELCACHE_DIR"]}
    )
    near = report["nearest"][0]
    assert [d["label"] for d in near["differences"]] == ["toolchain.environment.CPATH"]
    words = near["differences"][0]["words"]
    said = words.removeprefix("environment variable CPATH: unset → ")
    assert said != words
    # A long value is cut to 72 characters, "..." included (explain.words).
    assert said == str(tmp_path) or (said.endswith("...") and str(tmp_path).startswith(said[:-3]))
