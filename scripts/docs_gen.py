"""The parts of the documentation that come from the code, so that they cannot drift.

- ``settings_table()``: every setting, from :class:`kernelcache.settings.Settings`'s
  fields and ``kernelcache.cli.config.INTEGRATION_VARIABLES`` (what ``kernelcache
  config`` lists), with the description each declares in code.
- ``cli_reference()``: every command and option of ``kernelcache``, from its argparse parser.
- ``snippets()``: the code blocks of README.md and docs/ that the tests run
  (``tests/test_docs.py``): every ``python`` block, and every shell block marked
  ``<!-- run -->``; a block marked ``<!-- skip: REASON -->`` is skipped with that reason.

It is also the MkDocs hook (``mkdocs.yml``: ``hooks``): each page's
``<!-- generated: settings -->`` and ``<!-- generated: cli -->`` are replaced when the
site is built, and ``{{ version }}`` becomes ``kernelcache.__version__``.

    python scripts/docs_gen.py count      # how many snippets the tests run, and skip (why)
    python scripts/docs_gen.py settings   # print a generated part
    python scripts/docs_gen.py cli
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the hook runs in mkdocs' process, from any directory
    sys.path.insert(0, str(ROOT / "src"))

MARKERS = {"settings": "<!-- generated: settings -->", "cli": "<!-- generated: cli -->"}
VERSION = "{{ version }}"


def version() -> str:
    from kernelcache import __version__

    return __version__


# Settings ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_rows() -> list[tuple[str, str, str, str]]:
    """``(variable, setting, default, description)`` for every setting, in ``config``'s order."""
    from kernelcache.cli.config import INTEGRATION_VARIABLES, MEANINGS
    from kernelcache.settings import Settings

    rows = []
    for field in dataclasses.fields(Settings):
        if "variable" not in field.metadata:
            continue
        if field.default_factory is not dataclasses.MISSING:
            default = "platform user cache directory"
        else:
            default = _default(field.name, field.default)
        rows.append(
            (field.metadata["variable"], field.name, default, field.metadata.get("doc", ""))
        )
    for name, variable, _read, default in INTEGRATION_VARIABLES:
        rows.append((variable, name, default, MEANINGS.get(variable, "")))
    return rows


def _default(name: str, value: Any) -> str:
    from kernelcache.units import format_size

    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if name.endswith("max_bytes") and isinstance(value, int):
        return format_size(value)
    return str(value)


def undescribed() -> list[str]:
    """The variables that declare no description in code (each must have one)."""
    return [variable for variable, _name, _default, doc in settings_rows() if not doc.strip()]


def settings_table() -> str:
    lines = ["| variable (setting) | default | meaning |", "| --- | --- | --- |"]
    for variable, name, default, doc in settings_rows():
        lines.append(f"| `{variable}`<br>(`{name}`) | {_cell(default)} | {_cell(doc) or '–'} |")
    return "\n".join(lines)


# The command line ---------------------------------------------------------------------------


class _Wide(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=88)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, Any]]:
    # argparse has no public way to walk a parser: _actions is what its own help reads.
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {a.dest: a.help or "" for a in action._choices_actions}  # noqa: SLF001
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    rows = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):  # noqa: SLF001
            continue
        if action.help == argparse.SUPPRESS:
            continue
        # A tuple metavar names several values; none of kernelcache's options has one.
        named = action.metavar if isinstance(action.metavar, str) else None
        value = named or action.dest.upper()
        if action.choices and not isinstance(action.choices, dict):
            value = "{" + ",".join(map(str, action.choices)) + "}"
        if action.option_strings:
            spelled = ", ".join(action.option_strings)
            if action.nargs != 0:
                spelled += f" {value}"
        else:
            spelled = value if action.choices else named or action.dest
        about = action.help or ""
        rows.append((spelled, about))
    return rows


def cli_reference() -> str:
    from kernelcache.cli.main import build_parser

    parser = build_parser()
    parser.formatter_class = _Wide
    out = ["```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        out += [parser.description, ""]
    out += _option_table(_options(parser))
    if parser.epilog:
        out += ["", parser.epilog]
    for name, about, sub in _subcommands(parser):
        sub.formatter_class = _Wide
        out += ["", f"### `kernelcache {name}`", "", about or "", ""]
        out += ["```text", sub.format_usage().strip(), "```"]
        options = [row for row in _options(sub) if row[0] != "--dir DIR"]
        if options:
            out += ["", *_option_table(options)]
    return "\n".join(out)


def _option_table(rows: list[tuple[str, str]]) -> list[str]:
    lines = ["| argument | meaning |", "| --- | --- |"]
    lines += [f"| `{_cell(spelled)}` | {_cell(about) or '–'} |" for spelled, about in rows]
    return lines


GENERATORS = {"settings": settings_table, "cli": cli_reference}


def expand(markdown: str) -> str:
    """``markdown`` with every generated part filled in and the version written."""
    for name, marker in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, GENERATORS[name]())
    return markdown.replace(VERSION, version())


# Snippets ---------------------------------------------------------------------------------

SHELLS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"<!--\s*(run|skip:\s*(?P<why>.*?))\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository
    line: int
    language: str  # "python" or "bash"
    code: str
    skip: str  # the reason it is not run, or ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def snippets(paths: list[Path] | None = None) -> list[Snippet]:
    """The blocks the tests run: ``python`` ones, and shell ones marked ``<!-- run -->``."""
    found = []
    for path in pages() if paths is None else paths:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            language = match.group(1).lower()
            if language not in ("python", *SHELLS):
                continue
            before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
            mark = _MARK.search(before)
            if language in SHELLS and mark is None:
                continue  # an illustration (placeholders, a cluster's URL): not marked runnable
            why = (mark.group("why") or "") if mark else ""
            if mark and mark.group(1).startswith("skip") and not why.strip():
                raise ValueError(f"{path}: a skip mark must say why: <!-- skip: REASON -->")
            found.append(
                Snippet(
                    path=os.path.relpath(path, ROOT),
                    line=text.count("\n", 0, match.start()) + 1,
                    language="python" if language == "python" else "bash",
                    code=match.group(2),
                    skip=why.strip(),
                )
            )
    return found


def count() -> str:
    found = snippets()
    skipped = Counter(s.skip for s in found if s.skip)
    run = len(found) - sum(skipped.values())
    reasons = "; ".join(f"{n} {why}" for why, n in skipped.most_common())
    return f"docs snippets: {len(found)} found, {run} run by tests/test_docs.py, " + (
        f"{sum(skipped.values())} skipped ({reasons})" if skipped else "none skipped"
    )


# The MkDocs hook ------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    config["copyright"] = f"kernelcache {version()}"
    return config


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The documentation's generated parts.")
    parser.add_argument("what", choices=("count", *GENERATORS))
    args = parser.parse_args(argv)
    print(count() if args.what == "count" else GENERATORS[args.what]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
