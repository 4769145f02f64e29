"""scripts/matrix.py: its cells file, its pip lines, the table it renders (no venv is built here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kernelcache.versions import release

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "scripts" / "matrix.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["matrix"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_oldest_and_newest_tested_torch(matrix: ModuleType) -> None:
    pytest.importorskip("torch")
    from kernelcache.inductor import TESTED

    torch_cells = [c for c in matrix.read_cells() if c.integration == "torch"]
    versions = sorted(release(c.version) for c in torch_cells)
    assert all(release(c.version) in [versions[0], versions[-1]] for c in torch_cells if c.ci)
    assert versions[0][:2] == release(TESTED.oldest)
    assert versions[-1][:2] == release(TESTED.newest)
    assert all(c.version in TESTED for c in torch_cells)
    assert sum(c.ci for c in torch_cells) == 2


def test_a_pip_line_starts_with_its_environment(matrix: ModuleType) -> None:
    cell = matrix.Cell("torch", "2.15.0", "A=1 B=/dev/null torch==2.15.0 ; --no-deps x", [], False)
    assert cell.invocations() == [
        ({"A": "1", "B": "/dev/null"}, ["torch==2.15.0"]),
        ({}, ["--no-deps", "x"]),
    ]
    with pytest.raises(ValueError, match="empty pip invocation"):
        matrix.Cell("torch", "1", "A=1", [], False).invocations()


def test_a_malformed_cell_names_its_line(matrix: ModuleType, tmp_path: Path) -> None:
    cells = tmp_path / "cells"
    cells.write_text("# comment\n\ntorch 2.10.0 | torch==2.10.0 | tests | sometimes\n")
    with pytest.raises(SystemExit, match=r"cells:3: expected"):
        matrix.read_cells(cells)
    cells.write_text('torch 2.10.0 | torch==2.10.0 | tests | ci -m "not slow"\n')
    [cell] = matrix.read_cells(cells)
    assert cell.ci
    assert cell.ci_pytest == ["-m", "not slow"]
    cells.write_text("torch 2.10.0 | torch==2.10.0 | tests | - -m fast\n")
    with pytest.raises(SystemExit, match=r"cells:1: expected"):
        matrix.read_cells(cells)


def test_the_table_shows_each_cell_and_its_last_result(
    matrix: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results, page = tmp_path / "matrix.json", tmp_path / "page.md"
    monkeypatch.setattr(matrix, "RESULTS", results)
    monkeypatch.setattr(matrix, "PAGE", page)
    page.write_text(f"# Page\n{matrix.BEGIN}\nold\n{matrix.END}\nafter\n")
    run: dict[str, object] = {"integration": "torch", "version": "2.10.0", "result": "fail"}
    run |= {"date": "2026-11-28", "passed": 20, "failed": 2, "errors": 0, "skipped": 1}
    run["duration_s"] = 300
    matrix.record([run])
    assert json.loads(results.read_text())["cells"]["torch 2.10.0"]["failed"] == 2
    cells = [
        matrix.Cell("torch", "2.10.0", "torch==2.10.0", [], True),
        matrix.Cell("torch", "2.11.0", "torch==2.11.0", [], False),
    ]
    matrix.render(cells)
    text = page.read_text()
    assert "old" not in text
    assert text.endswith(f"{matrix.END}\nafter\n")
    row = "| torch | 2.10.0 | fail | 20 passed, 2 failed, 1 skipped (300 s) | 2026-11-28 | yes |"
    assert row in text
    assert "| torch | 2.11.0 | not run yet |  |  | no |" in text
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="are missing"):
        matrix.render(cells)
