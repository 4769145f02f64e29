"""The key rule and the disk tier's folder-tag rule, over generated strings.

Keys must match ``[A-Za-z0-9_][A-Za-z0-9_.\\-]{0,199}`` (they become file names
and Redis keys) and extraction folders ``[0-9a-f]{16}``; the tag is checked
with str methods on the disk tier's listing path. Both rules are compared with
their reference regexes, look-alike characters included.
"""

from __future__ import annotations

import random
import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernelcache.stores.base import is_valid_key, validate_key
from kernelcache.stores.disk import layout as disk_layout

KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
TAG_RE = re.compile(r"[0-9a-f]{16}")

# Allowed characters, their neighbours in ASCII, and look-alikes outside it
# (Kelvin sign, fullwidth digit, dotless i, long s, NUL, newline, surrogate).
NEAR = string.ascii_letters + string.digits + "_.-" + "/\\ +,:;@[]`{}~^\x7f"
ODD = "\u212a\u0130\u0131\u017f\uff10\u00e4\x00\n\t\ud800"


def keyish(rng: random.Random, pool: str) -> str:
    length = rng.choice([0, 1, 2, 3, 16, 64, 199, 200, 201, rng.randrange(0, 260)])
    text = [rng.choice(pool) for _ in range(length)]
    if text and rng.random() < 0.3:
        text[rng.randrange(len(text))] = rng.choice(ODD)
    return "".join(text)


def test_key_check_agrees_with_the_regex_on_every_short_string() -> None:
    pool = NEAR + ODD
    for a in pool:
        assert is_valid_key(a) == (KEY_RE.fullmatch(a) is not None), repr(a)
        for b in pool:
            assert is_valid_key(a + b) == (KEY_RE.fullmatch(a + b) is not None), repr(a + b)


class _Fresh(str):
    """validate_key remembers only exact ``str`` keys: a subclass is checked anew every time."""


def test_key_check_agrees_with_the_regex_on_generated_strings() -> None:
    rng = random.Random(1234)
    for _ in range(20_000):
        key = keyish(rng, NEAR)
        expected = KEY_RE.fullmatch(key) is not None
        assert is_valid_key(key) == expected, repr(key)
        assert is_valid_key(_Fresh(key)) == expected, repr(key)  # not via the memo of valid keys
        if not expected:  # is_valid_key is validate_key's answer; this is its error
            with pytest.raises(ValueError, match="invalid cache key"):
                validate_key(key)


@given(st.text(max_size=210) | st.text(alphabet=NEAR, max_size=210))
def test_key_check_agrees_with_the_regex_property(key: str) -> None:
    assert is_valid_key(key) == (KEY_RE.fullmatch(key) is not None)


class _LyingStr(str):
    """Claims another length and first character: the check must read the real ones."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: object) -> str:
        return "a"


@pytest.mark.parametrize("key", ["", ".hidden", "-x", "a" * 201, "a/b"])
def test_a_str_subclass_is_checked_by_its_characters(key: str) -> None:
    assert KEY_RE.fullmatch(key) is None
    assert not is_valid_key(_LyingStr(key))
    assert is_valid_key(_LyingStr("ok.key"))


def test_tag_check_agrees_with_the_regex() -> None:
    rng = random.Random(99)
    pool = string.hexdigits + "gG \n" + ODD
    tags = ["", "0" * 16, "f" * 16, "F" * 16, "0" * 15, "0" * 17, "0123456789abcdef"]
    tags += [
        "".join(rng.choice(pool) for _ in range(rng.choice([15, 16, 16, 16, 17])))
        for _ in range(20_000)
    ]
    for tag in tags:
        assert disk_layout.is_tag(tag) == (TAG_RE.fullmatch(tag) is not None), repr(tag)
