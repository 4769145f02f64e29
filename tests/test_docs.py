"""Docs that cannot lie (issue 39): the README's size, the generated pages, the benchmark
tables against their JSON, and every snippet the docs mark runnable, run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_env import clean_env, make_bin, stop_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_gen  # noqa: E402 (scripts/ is not a package)

import render  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))
sys.path.remove(str(ROOT / "benchmarks"))

SNIPPETS = docs_gen.snippets()


def test_the_readme_fits_on_one_screenful_of_pages() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_the_readme_links_every_tool_to_its_page() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = ("nvrtc", "nvcc", "triton", "tilelang", "ninetoothed", "torch-compile", "jax")
    for page in (*pages, "llm-servers", "team", "guarantees", "benchmarks", "configuration"):
        assert f"(docs/{page}.md)" in readme, page
    for page in pages[:-1]:  # jax.md and llm-servers.md come with their integrations
        assert (ROOT / "docs" / f"{page}.md").exists(), page


def test_every_setting_says_what_it_means() -> None:
    assert docs_gen.undescribed() == [], (
        "give each new setting a description: doc= in its _variable(...) in settings.py, "
        "or an entry in kernelcache.cli.config.MEANINGS"
    )


def test_the_settings_page_lists_what_kernelcache_config_lists() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kernelcache", "config", "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    listed = {row["variable"] for row in json.loads(out.stdout) if row["variable"]}
    table = docs_gen.settings_table()
    documented = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert "| `KERNELCACHE_DIR`<br>(`dir`) |" in table
    assert documented == listed


def test_the_command_line_page_lists_every_command_and_option() -> None:
    from kernelcache.cli.main import COMMANDS, DELEGATED

    page = docs_gen.cli_reference()
    for command in (*COMMANDS, *DELEGATED):
        assert f"### `kernelcache {command}`" in page, command
    assert "| `--max-size SIZE` | keep at most SIZE (5G) |" in page
    assert "| `action {status,stop}` |" not in page  # a positional with choices reads as them
    assert "| `{status,stop}` | show it, or stop it |" in page


def test_the_site_says_which_version_it_describes() -> None:
    from kernelcache import __version__

    assert docs_gen.VERSION in (ROOT / "docs" / "index.md").read_text()
    assert docs_gen.expand(f"kernelcache {docs_gen.VERSION}") == f"kernelcache {__version__}"
    generated = docs_gen.expand((ROOT / "docs" / "configuration.md").read_text())
    assert "<!-- generated:" not in generated
    assert "`KERNELCACHE_MAX_SIZE`" in generated


def test_the_benchmark_tables_are_what_their_json_says() -> None:
    assert render.stale() == [], "run python benchmarks/render.py and commit the pages"
    page = render.PAGE.read_text()
    for path in sorted(render.RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        assert f"### {doc['benchmark']}" in page
        for target in doc["targets"]:
            row = f"| {render.target_name(target)} | {render.cell(target['measured'])} |"
            assert row in page


def test_a_figure_changed_in_its_json_makes_the_page_stale(tmp_path: Path) -> None:
    files = sorted(render.RESULTS.glob("*.json"))
    assert files, "no benchmark results committed under docs/bench/"
    shutil.copytree(render.RESULTS, tmp_path / "bench")
    edited = tmp_path / "bench" / files[0].name
    doc = json.loads(edited.read_text())
    doc["targets"][0]["measured"] = "a figure typed by hand"
    edited.write_text(json.dumps(doc))
    assert render.PAGE in render.stale(tmp_path / "bench")


def test_the_snippet_runner_finds_marked_blocks_and_reasons(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nrm -rf /\n```\n\n<!-- run -->\n```bash\ntrue\n```\n\n"
        "<!-- skip: needs a GPU -->\n```python\nimport cupy\n```\n\n```python\nx = 1\n```\n"
    )
    found = docs_gen.snippets([page])
    assert [(s.language, s.code.strip(), s.skip) for s in found] == [
        ("bash", "true", ""),
        ("python", "import cupy", "needs a GPU"),
        ("python", "x = 1", ""),
    ]
    page.write_text("<!-- skip: -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="must say why"):
        docs_gen.snippets([page])


def test_the_snippets_are_counted() -> None:
    line = docs_gen.count()
    assert line.startswith(f"docs snippets: {len(SNIPPETS)} found")
    assert any(s.language == "bash" and not s.skip for s in SNIPPETS)
    assert any(s.path == "README.md" for s in SNIPPETS)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet(snippet: docs_gen.Snippet, tmp_path: Path) -> None:
    """Each block runs, as a reader would run it: in a fresh directory holding examples/,
    with its own cache directory and this checkout's `kernelcache` on PATH."""
    if snippet.skip:
        pytest.skip(f"{snippet.id}: {snippet.skip}")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")
    cache = tmp_path / "cache"
    bin_dir = make_bin(tmp_path / "bin").parent
    env = clean_env(cache)
    env.pop("TRITON_CACHE_MANAGER", None)
    env.pop("TRITON_CACHE_DIR", None)
    env["PATH"] = f"{bin_dir}:{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONWARNINGS"] = "ignore"  # a tool's deprecation notices are not the snippet's
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    if snippet.language == "python":  # a file: TileLang reads its kernels' source
        (work / "snippet.py").write_text(snippet.code)
        command = [sys.executable, "snippet.py"]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", snippet.code]
    try:
        proc = subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, timeout=280, check=False
        )
    finally:
        stop_server(cache)
    assert proc.returncode == 0, (
        f"{snippet.id} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    if snippet.code.rstrip().endswith("kernelcache stats"):
        # A block that ends by showing the statistics promises a hit: the cache must have one.
        assert _hits(cache, env) > 0, f"{snippet.id}: no hit\n{proc.stdout[-3000:]}"


def _hits(cache: Path, env: dict[str, str]) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "kernelcache", "stats", "--json"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    report = json.loads(out.stdout)
    tiers = sum(int(t.get("hits", 0)) for t in report["lifetime"]["tiers"].values())
    return tiers + int((report.get("nvcc_launcher") or {}).get("hits", 0))
