"""Render the benchmark tables of docs/benchmarks.md and README.md from the committed JSON.

Every ``docs/bench/*.json`` is one run of one benchmark, written by its ``--json FILE``
(``results.py``). This script writes, between the markers of each page, the tables those
files hold, so that no figure is typed by hand:

    python benchmarks/render.py           # rewrite the pages
    python benchmarks/render.py --check   # exit 1, naming the page, when one differs

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BLOCKS = {"bench": ("<!-- bench:start -->", "<!-- bench:end -->"),
          "headline": ("<!-- headline:start -->", "<!-- headline:end -->")}  # fmt: skip

#: README's headline figures: (benchmark, the start of the targets' names); every target
#: that matches is shown, met or missed.
HEADLINES = (
    ("bench_stores", "memory hit"),
    ("bench_stores", "disk hit ≤ fastest peer"),
    ("bench_compilers", "NVRTC memory hit, saxpy.cu"),
    ("bench_compilers", "NVRTC cold compile"),
    ("bench_launcher", "`kernelcache nvcc` hit"),
    ("bench_triton", "Triton stampede"),
    ("bench_redis", "Redis server hit, signed"),
    ("bench_singleflight", "waiter latency after a compile, processes, 3"),
)  # fmt: skip


def load(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """The results documents, in the order of their benchmark's name."""
    docs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return sorted(docs, key=lambda d: str(d["benchmark"]))


def cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def target_name(t: Mapping[str, Any]) -> str:
    """A target's name, with its limit where the name does not say it."""
    return cell(f"{t['target']} ({t['limit']})" if t.get("limit") else t["target"])


def _verdict(text: str) -> str:
    return "**MISS**" if text == "MISS" else text


def section(doc: Mapping[str, Any]) -> str:
    """One benchmark's heading, conditions and targets table."""
    m = doc["machine"]
    load_before = m.get("loadavg", ["?"])[0]
    load_after = m.get("loadavg_after", ["?"])[0]
    lines = [
        f"### {doc['benchmark']}",
        "",
        f"`{doc['command']}`, {doc['date'][:16].replace('T', ' ')} UTC, kernelcache "
        f"{m.get('kernelcache', '?')} ({m.get('commit', '?')}); {m.get('cpu', '?')}, "
        f"{m.get('cpus', '?')} CPUs, Python {m.get('python', '?')}, {m.get('system', '?')}; "
        f"load average {load_before} at the start, {load_after} at the end.",
        "",
        "Contenders: " + ", ".join(cell(c) for c in doc["contenders"]) + ".",
        "",
        "| target | measured | ratio | verdict |",
        "| --- | --- | ---: | --- |",
    ]
    for t in doc["targets"]:
        lines.append(
            f"| {target_name(t)} | {cell(t['measured'])} | {cell(t.get('ratio', ''))} "
            f"| {_verdict(t['verdict'])} |"
        )
    return "\n".join(lines)


def scripts() -> list[str]:
    return sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def bench_block(docs: list[dict[str, Any]]) -> str:
    parts = [section(d) for d in docs]
    have = {d["benchmark"] for d in docs}
    missing = [s for s in scripts() if s not in have]
    if missing:
        parts.append(
            "### Not measured for this version yet\n\n"
            + "\n".join(
                f"- {name}: `python benchmarks/{name}.py --json docs/bench/{name}.json`"
                for name in missing
            )
        )
    return "\n\n".join(parts)


def headline_block(docs: list[dict[str, Any]]) -> str:
    by_name = {d["benchmark"]: d for d in docs}
    lines = ["| target | measured | ratio | verdict |", "| --- | --- | ---: | --- |"]
    for benchmark, prefix in HEADLINES:
        doc = by_name.get(benchmark)
        rows = [t for t in doc["targets"] if t["target"].startswith(prefix)] if doc else []
        for t in rows:
            lines.append(
                f"| {target_name(t)} | {cell(t['measured'])} | {cell(t.get('ratio', ''))} "
                f"| {_verdict(t['verdict'])} |"
            )
    return "\n".join(lines)


def fill(text: str, block: str, content: str) -> str:
    """``text`` with what lies between ``block``'s markers replaced by ``content``."""
    start, end = BLOCKS[block]
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {start} and one {end}")
    head, rest = text.split(start)
    _old, tail = rest.split(end)
    return f"{head}{start}\n{content}\n{end}{tail}"


def rendered(folder: Path = RESULTS) -> dict[Path, str]:
    """Each page as it must read for the JSON files in ``folder``."""
    docs = load(folder)
    return {
        PAGE: fill(PAGE.read_text(), "bench", bench_block(docs)),
        README: fill(README.read_text(), "headline", headline_block(docs)),
    }


def stale(folder: Path = RESULTS) -> list[Path]:
    """The pages whose tables differ from what the JSON files say."""
    return [page for page, text in rendered(folder).items() if page.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        out = stale()
        for page in out:
            print(f"{page.relative_to(ROOT)}: tables differ from docs/bench/*.json; "
                  "run python benchmarks/render.py", file=sys.stderr)  # fmt: skip
        return 1 if out else 0
    for page, text in rendered().items():
        if page.read_text() != text:
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
