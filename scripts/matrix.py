"""The version matrix: each integration's own tests in one cached venv per release of its tool.

Run through scripts/matrix.sh (see its header for the command line). The cells
are the lines of scripts/matrix.cells. For each selected cell this

1. builds or reuses the cell's venv, ``$KERNELCACHE_MATRIX_DIR/<integration>-<version>/``
   (default ``~/.cache/kernelcache-matrix``): a stamp file in it records the
   cell's pip arguments and the test dependencies installed. Other pip
   arguments: the venv is built again from nothing. Other test dependencies
   only: they are installed into it. A venv without a stamp (built by hand,
   say with the tool alone) is adopted: the cell's pip arguments and the test
   dependencies are installed into it, which pip finds already satisfied for
   what is there;
2. runs the cell's pytest arguments from this checkout with ``PYTHONPATH=src``,
   so the tests exercise this checkout's kernelcache against that release;
3. records the result (passed, failed, errors, skipped, date, duration, the
   release actually installed) in docs/matrix.json, and renders the table of
   docs/compatibility.md between its two marker lines from that file.

``--ci`` runs the cells marked ``ci`` and records nothing (CI checks; the
committed table is written by full runs). The exit status is 1 when a cell
failed or its venv could not be built.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CELLS = ROOT / "scripts" / "matrix.cells"
RESULTS = ROOT / "docs" / "matrix.json"
PAGE = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
STAMP = ".kernelcache-matrix.json"
# The package whose installed release a cell reports, where it is not the integration's name.
PACKAGES = {"cuda.core": "cuda-core"}
# Test extras the cells do not need: linters and type checkers run once, in .venv.
NOT_FOR_CELLS = {"ruff", "mypy"}
_ENV = re.compile(r"[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Cell:
    integration: str
    version: str
    pip: str  # the pip field as written: " ; " between invocations
    pytest: list[str]
    ci: bool

    @property
    def name(self) -> str:
        return f"{self.integration}-{self.version}"

    @property
    def label(self) -> str:
        return f"{self.integration} {self.version}"

    def invocations(self) -> list[tuple[dict[str, str], list[str]]]:
        """Each pip invocation: its leading ``NAME=value`` words (environment), then its arguments."""
        out = []
        for part in self.pip.split(" ; "):
            words = shlex.split(part)
            env = {}
            while words and _ENV.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if not words:
                raise ValueError(f"{self.label}: an empty pip invocation in {self.pip!r}")
            out.append((env, words))
        return out


def read_cells(path: Path = CELLS) -> list[Cell]:
    cells = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != 4 or len(fields[0].split()) != 2 or fields[3] not in ("ci", "-"):
            raise SystemExit(
                f"{path}:{number}: expected '<integration> <version> | <pip arguments> | "
                f"<pytest arguments> | ci or -', got {raw!r}"
            )
        integration, version = fields[0].split()
        cells.append(
            Cell(integration, version, fields[1], shlex.split(fields[2]), fields[3] == "ci")
        )
    return cells


def test_requirements() -> list[str]:
    """What the tests import besides the tool: kernelcache's own dependencies, its redis and
    test extras (pyproject.toml, so a dependency added there reaches every cell)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["redis"], *extras["test"]]
    return [r for r in wanted if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] not in NOT_FOR_CELLS]


def log(message: str) -> None:
    print(f"matrix: {message}", flush=True)


def pip(venv: Path, args: list[str], env: dict[str, str] | None = None) -> None:
    command = [str(venv / "bin" / "python"), "-m", "pip", "install", "-qq", *args]
    log(" ".join([*(f"{k}={v}" for k, v in (env or {}).items()), "pip install", *args]))
    subprocess.run(command, env={**os.environ, **(env or {})}, check=True)


def prepare(cell: Cell, base: Path) -> Path:
    """The cell's venv, built, adopted or reused (see the module docstring)."""
    venv = base / cell.name
    stamp_path = venv / STAMP
    deps = test_requirements()
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    if stamp is not None and stamp.get("pip") != cell.pip:
        log(f"{cell.label}: its pip arguments changed; building its venv again")
        shutil.rmtree(venv)
        stamp = None
    if not (venv / "bin" / "python").exists():
        log(f"{cell.label}: creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if stamp is None:
        for env, args in cell.invocations():
            pip(venv, args, env)
        stamp = {"pip": cell.pip, "deps": []}
        stamp_path.write_text(json.dumps(stamp))
    if stamp["deps"] != deps:
        pip(venv, deps)
        stamp["deps"] = deps
        stamp_path.write_text(json.dumps(stamp))
    return venv


def installed(venv: Path, integration: str) -> str | None:
    package = PACKAGES.get(integration, integration)
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, package], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def counts(junit: Path) -> dict[str, int]:
    suites = ET.parse(junit).getroot()
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites.iter("testsuite"):
        for field in total:
            total[field] += int(suite.get(field, 0))
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def run(cell: Cell, base: Path) -> dict[str, object]:
    started = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    result: dict[str, object] = {
        "integration": cell.integration,
        "version": cell.version,
        "date": date,
        "ci": cell.ci,
        "pytest": shlex.join(cell.pytest),
    }
    base.mkdir(parents=True, exist_ok=True)
    # One build of a venv at a time, whoever runs the matrix (two checkouts, say).
    with open(base / f"{cell.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            venv = prepare(cell, base)
        except (subprocess.CalledProcessError, OSError, ValueError) as exc:
            log(f"{cell.label}: its venv could not be built: {exc}")
            return {**result, "result": "no venv", "why": str(exc)}
    result["installed"] = installed(venv, cell.integration)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="kc-matrix-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider"]
        command += ["-q", "--durations=5", f"--junitxml={junit}", *cell.pytest]
        log(f"{cell.label}: {shlex.join(command[1:])}")
        proc = subprocess.run(command, cwd=ROOT, env=env)
        found = counts(junit) if junit.exists() else {"passed": 0, "failed": 0, "errors": 1}
    ok = proc.returncode == 0
    result.update(found)
    result["result"] = "pass" if ok else "fail"
    result["duration_s"] = round(time.monotonic() - started)
    log(f"{cell.label}: {result['result']} {found} in {result['duration_s']} s")
    return result


def record(results: list[dict[str, object]]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cells": {}}
    for result in results:
        data["cells"][f"{result['integration']} {result['version']}"] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def table(cells: list[Cell]) -> str:
    """The Markdown between the page's markers: one row per cell, in the cells file's order."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cells": {}}
    rows = [
        "| integration | release | result | tests | date | in CI |",
        "|---|---|---|---|---|---|",
    ]
    for cell in cells:
        got = data["cells"].get(cell.label)
        if got is None:
            result, tests, date = "not run yet", "", ""
        else:
            result = str(got["result"])
            if got.get("why"):
                result += f": {got['why']}"
            parts = [f"{got.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped")]
            tests = ", ".join(p for p in parts if not p.startswith("0 ") or p.endswith("passed"))
            tests += f" ({got.get('duration_s', '?')} s)" if "duration_s" in got else ""
            date = str(got["date"])
        rows.append(
            f"| {cell.integration} | {cell.version} | {result} | {tests} | {date} "
            f"| {'yes' if cell.ci else 'no'} |"
        )
    return "\n".join(rows)


def render(cells: list[Cell]) -> None:
    text = PAGE.read_text()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{PAGE}: the lines {BEGIN} and {END} are missing")
    PAGE.write_text(f"{head}{BEGIN}\n{table(cells)}\n{END}{tail}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/matrix.sh", description=__doc__.split("\n")[0])
    parser.add_argument("integration", nargs="?", help="only this integration's cells")
    parser.add_argument("version", nargs="?", help="only this release")
    parser.add_argument(
        "--ci", action="store_true", help="only the cells marked ci; record nothing"
    )
    parser.add_argument("--list", action="store_true", help="print the selected cells, run nothing")
    parser.add_argument("--render", action="store_true", help="render the page only, run nothing")
    args = parser.parse_args(argv)
    cells = read_cells()
    if args.render:
        render(cells)
        return 0
    chosen = [
        c
        for c in cells
        if (args.integration in (None, c.integration))
        and (args.version in (None, c.version))
        and (c.ci or not args.ci)
    ]
    if not chosen:
        raise SystemExit(f"matrix: no cell matches {args.integration} {args.version or ''}")
    if args.list:
        for cell in chosen:
            print(
                f"{cell.label}\t{'ci' if cell.ci else '-'}\t{cell.pip}\t{shlex.join(cell.pytest)}"
            )
        return 0
    base = Path(
        os.environ.get("KERNELCACHE_MATRIX_DIR") or Path.home() / ".cache" / "kernelcache-matrix"
    )
    results = [run(cell, base) for cell in chosen]
    if not args.ci:
        record(results)
        render(cells)
    for result in results:
        log(f"{result['integration']} {result['version']}: {result['result']}")
    return 0 if all(r["result"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
