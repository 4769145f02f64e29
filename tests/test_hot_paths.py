"""The fast paths taken for speed keep the exact behaviour of the slow ones."""

from __future__ import annotations

import pytest

from kernelcache.stores import base
from kernelcache.stores.base import validate_key


class _SneakyStr(str):
    """Equal to (and hashing like) any key: must never pass as an already-checked key."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("a" * 64)


def test_validate_key_memo_accepts_and_rejects_as_the_regex_does() -> None:
    good = "a" * 64
    assert validate_key(good) is good
    assert validate_key(good) is good  # second time: from the memo
    for bad in ("", ".x", "-x", "a/b", "a" * 201, "ä", "a b", None, 1, b"abc", ["a"]):
        with pytest.raises(ValueError, match="invalid cache key"):
            validate_key(bad)
        with pytest.raises(ValueError, match="invalid cache key"):
            validate_key(bad)  # a rejected key is never remembered
    with pytest.raises(ValueError, match="invalid cache key"):
        validate_key(_SneakyStr("../../etc/passwd"))


def test_validate_key_memo_stays_bounded() -> None:
    for i in range(base._VALID_KEYS_MAX + 10):
        validate_key(f"k{i}")
    assert len(base._VALID_KEYS) <= base._VALID_KEYS_MAX
    assert validate_key("k1") == "k1"  # still valid after the memo was cleared
