"""What the C preprocessor reads from a source's text: include directives and time macros.

Every scanner of sources (the nvcc launcher's failed-lookup tracking, NVRTC's
and cuda.core's header keys) uses these rules, so that a spelling is
understood, or refused, the same way everywhere (issue 19).

The preprocessor's view is rebuilt as far as it can be exactly: line splices
(a backslash, optional blanks, a newline) are joined first, as translation
phase 2 does; ``%:`` is ``#`` (a digraph); a comment between ``#``, the
directive's name and the header name is a blank. A directive is then
``include``, ``include_next`` or ``import`` with a literal ``"name"`` or
``<name>``, and ``__has_include(...)``/``__has_include_next(...)`` with a
literal name. Whatever could still name a header but is not in those forms
(``#include MACRO``, ``__has_include(MACRO)``, extra tokens, a trigraph, a
directive split by a comment across lines) makes the scan *unsure*, with the
reason: callers then fall back to the preprocessor's own output or do not
cache, never leave a dependency out.

The fast path is one regular expression per line that names ``include`` or
``import``; the careful reading runs only for lines it does not match.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

__all__ = [
    "TIME_MACROS",
    "Directives",
    "scan",
    "time_macro",
]

TIME_MACROS = (b"__TIME__", b"__DATE__", b"__TIMESTAMP__")

_BLANK = rb"[ \t\f\v]"
_SPLICE = re.compile(rb"\\" + _BLANK + rb"*\r?\n")
#: The usual spelling, understood at once.
_EXACT = re.compile(
    rb"^"
    + _BLANK
    + rb"*(?:#|%:)"
    + _BLANK
    + rb"*(include_next|include|import)"
    + _BLANK
    + rb'*(?:"([^"\n]*)"|<([^>\n]*)>)'
    + _BLANK
    + rb"*(?://.*)?\r?$"
)
_COMMENT = re.compile(rb"/\*.*?\*/")
#: What may stand before a comment that a directive goes on after (``# /* ...``).
_BEFORE_OPEN = re.compile(
    _BLANK + rb"*(?:#|%:)" + _BLANK + rb"*(?:(?:include_next|include|import)" + _BLANK + rb"*)?$"
)
_DIRECTIVE = re.compile(rb"^" + _BLANK + rb"*(?:#|%:)" + _BLANK + rb"*([A-Za-z_]\w*)?")
_NAME = re.compile(_BLANK + rb'*(?:"([^"\n]*)"|<([^>\n]*)>)' + _BLANK + rb"*(?://.*)?\r?$")
_HAS_INCLUDE = re.compile(rb"__has_include(_next)?")
_HAS_LITERAL = re.compile(rb'\s*\(\s*(?:"([^"\n]*)"|<([^>\n]*)>)\s*\)')
#: ``defined(__has_include)``, ``#ifdef __has_include``: a test, not a lookup.
_HAS_TEST = re.compile(rb"(?:defined\s*\(?|#\s*if(?:n)?def)\s*$")
_INCLUDES = (b"include", b"include_next", b"import")


class Directives(NamedTuple):
    """The headers a file names: ``(quoted, next, name)`` each; ``unsure`` says what was not understood."""

    includes: tuple[tuple[bool, bool, str], ...]
    unsure: str | None


def _join(data: bytes) -> bytes:
    """The text after translation phase 2 (line splices removed, a leading BOM dropped)."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    return _SPLICE.sub(b"", data) if b"\\" in data else data


def scan(data: bytes) -> Directives:
    """Every header ``data`` may include (in inactive branches and comments too)."""
    text = _join(data)
    if b"??=" in text or b"??/" in text:
        return Directives((), "a trigraph (??= or ??/)")
    comments = _Comments(text)
    unsure = _open_comment(text, comments)
    if unsure is not None:
        return Directives((), unsure)
    found: list[tuple[bool, bool, str]] = []
    for start, line in _lines(text, (b"include", b"import")):
        exact = _EXACT.match(line)
        if exact is not None:
            found.append(_entry(exact.group(1), exact.group(2), exact.group(3)))
            continue
        unsure = _careful(line, found)
        # A "#" inside a block comment (prose such as "#include's protect themselves") is no directive.
        if unsure is not None and not comments.covers(start + _hash_at(line)):
            return Directives((), unsure)
    if b"__has_include" in text:
        unsure = _has_include(text, found, comments)
        if unsure is not None:
            return Directives((), unsure)
    return Directives(tuple(dict.fromkeys(found)), None)


#: Comments and literals, for telling a line inside a comment from a directive.
_TOKENS = re.compile(rb'/\*.*?(?:\*/|\Z)|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


class _Comments:
    """Where ``text``'s comments are, found once and only for a file that needs it."""

    def __init__(self, text: bytes) -> None:
        self.text = text
        self._spans: list[tuple[int, int]] | None = None

    def covers(self, at: int) -> bool:
        """Whether offset ``at`` lies inside a comment."""
        if self._spans is None:
            self._spans = [m.span() for m in _TOKENS.finditer(self.text) if m.group()[:1] == b"/"]
        import bisect

        i = bisect.bisect_right(self._spans, (at, len(self.text) + 1)) - 1
        return i >= 0 and self._spans[i][0] < at < self._spans[i][1]


def _lines(text: bytes, words: tuple[bytes, ...]) -> list[tuple[int, bytes]]:
    """The lines of ``text`` that contain one of ``words`` (``str.find`` beats a regex ten-fold)."""
    spans: dict[int, int] = {}
    for word in words:
        at = text.find(word)
        while at >= 0:
            start = text.rfind(b"\n", 0, at) + 1
            end = text.find(b"\n", at)
            end = len(text) if end < 0 else end
            spans[start] = end
            at = text.find(word, end)
    return [(start, text[start : spans[start]]) for start in sorted(spans)]


def _hash_at(line: bytes) -> int:
    """Where the line's first ``#`` or ``%:`` is (0 if it has none)."""
    found = [i for i in (line.find(b"#"), line.find(b"%:")) if i >= 0]
    return min(found, default=0)


def _open_comment(text: bytes, comments: _Comments) -> str | None:
    """Why a directive goes on after a comment that ends on a later line, if one does."""
    at = text.find(b"/*")
    while at >= 0:
        start = text.rfind(b"\n", 0, at) + 1
        if _BEFORE_OPEN.match(text, start, at) and not comments.covers(at):
            end = text.find(b"\n", at)
            line = text[start : len(text) if end < 0 else end]
            if b"/*" in _COMMENT.sub(b" ", line):
                spelled = line.decode("utf-8", "replace").strip()[:80]
                return f"a directive continued by a comment across lines: {spelled}"
        at = text.find(b"/*", at + 2)
    return None


def _entry(word: bytes, quoted: bytes | None, angled: bytes | None) -> tuple[bool, bool, str]:
    name = quoted if quoted is not None else angled or b""
    return quoted is not None, word == b"include_next", os.fsdecode(name.strip())


def _careful(line: bytes, found: list[tuple[bool, bool, str]]) -> str | None:
    """Read a line the fast path did not match; ``None`` when it is understood."""
    spelled = line.decode("utf-8", "replace").strip()[:80]
    bare = _COMMENT.sub(b" ", line)
    directive = _DIRECTIVE.match(bare)
    if directive is None:
        # Not a directive, unless a comment begun on a line above ends here
        # and a directive follows it (gcc reads "/* a\nb */ #include" so).
        close = bare.find(b"*/")
        if close >= 0 and bare[close + 2 :].lstrip().startswith((b"#", b"%:")):
            return f"a directive after a comment begun above: {spelled}"
        return None
    word = directive.group(1)
    if word not in _INCLUDES:
        return None  # another directive (#pragma, #define, #if: __has_include is read below)
    name = _NAME.match(bare, directive.end())
    if name is None:
        return f"an include it cannot resolve without a preprocessor: {spelled}"
    found.append(_entry(word, name.group(1), name.group(2)))
    return None


def _has_include(
    text: bytes, found: list[tuple[bool, bool, str]], comments: _Comments
) -> str | None:
    for m in _HAS_INCLUDE.finditer(text):
        literal = _HAS_LITERAL.match(text, m.end())
        if literal is not None:
            next_ = b"include_next" if m.group(1) else b"include"
            found.append(_entry(next_, literal.group(1), literal.group(2)))
            continue
        if _HAS_TEST.search(text, max(0, m.start() - 40), m.start()) or comments.covers(m.start()):
            continue  # defined(__has_include), #ifdef __has_include, or a comment
        end = text.find(b"\n", m.start())
        spelled = text[m.start() : end if end >= 0 else None].decode("utf-8", "replace")
        return f"a __has_include it cannot resolve without a preprocessor: {spelled[:80]}"
    return None


def time_macro(data: bytes) -> str | None:
    """The first time macro (``__TIME__``, ``__DATE__``, ``__TIMESTAMP__``) ``data`` names."""
    if b"__" not in data:
        return None
    text = _join(data) if b"\\" in data else data
    for macro in TIME_MACROS:
        if macro in text:
            return macro.decode()
    return None
