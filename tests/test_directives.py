"""kernelcache.directives: every spelling of an include is understood exactly, or the scan says it is unsure.

The compile-level tests (tests/test_nvcc_inputs.py, tests/test_nvrtc_inputs.py)
check the same spellings against real nvcc and NVRTC; this table pins the reader.
"""

from __future__ import annotations

import pytest

from kernelcache import directives
from kernelcache.sloppiness import sloppiness, time_macros_allowed

UNDERSTOOD = [
    pytest.param(b'#include "h.h"\n', [(True, False, "h.h")], id="plain"),
    pytest.param(b"  #  include <h.h>  // why\n", [(False, False, "h.h")], id="blanks-comment"),
    pytest.param(b'#/**/include "h.h"\n', [(True, False, "h.h")], id="comment-after-hash"),
    pytest.param(b'# /* a */ include /* b */ "h.h"\n', [(True, False, "h.h")], id="comments"),
    pytest.param(b'%:include "h.h"\n', [(True, False, "h.h")], id="digraph"),
    pytest.param(b'#inc\\\nlude "h.h"\n', [(True, False, "h.h")], id="splice-in-name"),
    pytest.param(b'#include \\\n "h.h"\n', [(True, False, "h.h")], id="splice-before-header"),
    pytest.param(b'#include \\  \n"h.h"\n', [(True, False, "h.h")], id="splice-blanks"),
    pytest.param(b"#include_next <h.h>\n", [(False, True, "h.h")], id="include-next"),
    pytest.param(b'#import "h.h"\n', [(True, False, "h.h")], id="import"),
    pytest.param(b"#if __has_include(<h.h>)\n#endif\n", [(False, False, "h.h")], id="has-include"),
    pytest.param(b'#if __has_include_next("h.h")\n', [(True, True, "h.h")], id="has-next"),
    pytest.param(b"#ifdef __has_include\n#endif\n", [], id="has-include-test"),
    pytest.param(b"#if defined(__has_include)\n", [], id="has-include-defined"),
    pytest.param(b"#endif // __has_include\n", [], id="has-include-in-comment"),
    pytest.param(b"/* the first\n   #include's protect themselves */\n", [], id="prose-in-comment"),
    pytest.param(b"// #include <not/a/directive.h>\n", [], id="line-comment"),
    pytest.param(b"int include = 1; // import this\n", [], id="words-in-code"),
    pytest.param(b"#pragma once // include guard\n", [], id="other-directive"),
    pytest.param(b"\xef\xbb\xbf#include <h.h>\n", [(False, False, "h.h")], id="bom"),
]


@pytest.mark.parametrize(("text", "expected"), UNDERSTOOD)
def test_spellings_understood_exactly(text: bytes, expected: list[tuple[bool, bool, str]]) -> None:
    found = directives.scan(text)
    assert found.unsure is None
    assert list(found.includes) == expected


UNSURE = [
    pytest.param(b'#define H "h.h"\n#include H\n', "#include H", id="computed"),
    pytest.param(b"#define H <h.h>\n#if __has_include(H)\n", "__has_include(H)", id="has-computed"),
    pytest.param(b'#include "h.h" extra\n', "extra", id="extra-tokens"),
    pytest.param(b'??=include "h.h"\n', "trigraph", id="trigraph"),
    pytest.param(b'# /* a\n */ include "h.h"\n', "across lines", id="comment-across-lines"),
    pytest.param(b'/* a\nb */ #include "h.h"\n', "comment begun above", id="after-comment"),
    pytest.param(b'#include /* a\n */ "h.h"\n', "across lines", id="name-after-comment"),
    pytest.param(b"#define HAS(x) __has_include(x)\n", "__has_include(x)", id="has-wrapper"),
]


@pytest.mark.parametrize(("text", "why"), UNSURE)
def test_what_it_cannot_read_makes_it_unsure(text: bytes, why: str) -> None:
    found = directives.scan(text)
    assert found.unsure is not None
    assert why in found.unsure
    assert found.includes == ()


@pytest.mark.parametrize(
    ("text", "macro"),
    [
        pytest.param(b"const char* t = __TIME__;\n", "__TIME__", id="time"),
        pytest.param(b"__DATE__\n", "__DATE__", id="date"),
        pytest.param(b"x = __TIMESTAMP__;\n", "__TIMESTAMP__", id="timestamp"),
        pytest.param(b"x = __TI\\\nME__;\n", "__TIME__", id="spliced"),
        pytest.param(b"x = __TIME;\n", None, id="not-a-macro"),
    ],
)
def test_time_macros(text: bytes, macro: str | None) -> None:
    assert directives.time_macro(text) == macro


def test_one_reading_of_the_sloppiness() -> None:
    assert time_macros_allowed({"KERNELCACHE_SLOPPINESS": "time_macros"})
    assert not time_macros_allowed({})
    assert sloppiness({"KERNELCACHE_SLOPPINESS": "time_macros, time_macros"}) == {"time_macros"}
    with pytest.raises(ValueError, match=r"unknown value.*tyme_macros"):
        sloppiness({"KERNELCACHE_SLOPPINESS": "tyme_macros"})
