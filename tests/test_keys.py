"""Table-driven key tests: inputs that must differ, inputs that must agree."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kernelcache import keys
from kernelcache.keys import KeyBuilder, encode, make_key


def key(*fields: tuple[str, Any]) -> str:
    builder = KeyBuilder("test")
    for label, value in fields:
        builder.add(label, value)
    return builder.hexdigest()


MUST_DIFFER = [
    pytest.param(1, "1", id="int-vs-str"),
    pytest.param(1, True, id="int-vs-bool"),
    pytest.param(0, False, id="zero-vs-false"),
    pytest.param(1, 1.0, id="int-vs-float"),
    pytest.param("1", b"1", id="str-vs-bytes"),
    pytest.param(True, b"1", id="bool-vs-bytes"),
    pytest.param(None, "", id="none-vs-empty-str"),
    pytest.param(None, 0, id="none-vs-zero"),
    pytest.param(("a", "b"), ("ab",), id="tuple-split"),
    pytest.param(["a", "b"], ["a", "b", ""], id="trailing-empty"),
    pytest.param([["a"], "b"], ["a", ["b"]], id="nesting"),
    pytest.param(0.0, -0.0, id="signed-zero"),
    pytest.param({"a": 1}, {"a": "1"}, id="dict-value-type"),
    pytest.param({"a": 1}, [("a", 1)], id="dict-vs-pairs"),
    pytest.param(b"", "", id="empty-bytes-vs-str"),
    pytest.param("é", "e\u0301", id="unicode-not-normalised"),
    pytest.param(2**64, 2**64 + 1, id="big-int"),
    pytest.param(-1, 255, id="negative-vs-its-bytes"),
    pytest.param(-128, 128, id="sign-bit"),
    pytest.param(0, -0 - 1, id="zero-vs-minus-one"),
    pytest.param(10**5000, 10**5000 + 1, id="int-over-4300-digits"),
    pytest.param(-(10**5000), 10**5000, id="huge-negative"),
    pytest.param(256, b"\x01\x00", id="int-vs-its-bytes"),
    pytest.param(49, "1", id="int-vs-str-of-its-byte"),
]


@pytest.mark.parametrize(("a", "b"), MUST_DIFFER)
def test_values_that_must_differ(a: Any, b: Any) -> None:
    assert encode(a) != encode(b)
    assert key(("v", a)) != key(("v", b))


MUST_AGREE = [
    pytest.param({"a": 1, "b": 2}, {"b": 2, "a": 1}, id="dict-order"),
    pytest.param(("x", 1), ["x", 1], id="tuple-vs-list"),
    pytest.param(b"ab", bytearray(b"ab"), id="bytes-like"),
    pytest.param(float("nan"), -math.nan, id="nan"),
    pytest.param({"o": {"y": 1, "x": 2}}, {"o": {"x": 2, "y": 1}}, id="nested-dict-order"),
]


@pytest.mark.parametrize(("a", "b"), MUST_AGREE)
def test_values_that_must_agree(a: Any, b: Any) -> None:
    assert key(("v", a)) == key(("v", b))


def test_labels_and_field_boundaries_matter() -> None:
    assert key(("a", "bc")) != key(("ab", "c"))
    assert key(("a", 1), ("b", 2)) != key(("b", 2), ("a", 1))  # fields are ordered
    assert key(("a", 1)) != key(("a", 1), ("b", None))


def test_namespace_separates_tools() -> None:
    assert (
        KeyBuilder("nvrtc").add("s", "x").hexdigest()
        != KeyBuilder("triton").add("s", "x").hexdigest()
    )


def test_digest_is_stable_and_builder_reusable() -> None:
    builder = KeyBuilder("test").add("a", 1)
    first = builder.hexdigest()
    assert builder.hexdigest() == first
    assert builder.digest().hex() == first
    assert len(builder.digest()) == 32
    extended = builder.copy().add("b", 2)
    assert builder.hexdigest() == first
    assert extended.hexdigest() != first


def test_known_value_pins_the_schema() -> None:
    # A change of encoding must bump SCHEMA_VERSION; this pins today's output.
    assert (
        make_key("pin", b=2, a="x")
        == "453f1d8860783d72e8353f6c28656a60eec644558627030e394cdfca31c748af"
    )
    assert make_key("pin", b=2, a="x") == make_key("pin", a="x", b=2)


class Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(Opaque(), id="object"),
        pytest.param({1, 2}, id="set"),
        pytest.param(object, id="class"),
        pytest.param(lambda: 0, id="function"),
        pytest.param(1j, id="complex"),
    ],
)
def test_unkeyable_types_raise_type_error_naming_the_type(value: Any) -> None:
    with pytest.raises(TypeError, match=type(value).__qualname__):
        KeyBuilder("test").add("v", value)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(_nested(5000), id="list-5000-deep"),
        pytest.param(_nested(200), id="list-200-deep"),
        pytest.param({"a": _nested(5000)}, id="dict-holding-deep-list"),
    ],
)
def test_too_deep_nesting_raises_type_error(value: Any) -> None:
    """Issue 19: RecursionError before; the documented TypeError now."""
    with pytest.raises(TypeError, match="nested more than"):
        KeyBuilder("test").add("v", value)


def test_a_list_holding_itself_raises_type_error() -> None:
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(TypeError, match="contains itself"):
        KeyBuilder("test").add("v", looped)


def test_nesting_up_to_the_limit_is_keyed() -> None:
    assert key(("v", _nested(keys.MAX_DEPTH - 1))) != key(("v", _nested(keys.MAX_DEPTH - 2)))


def test_ints_of_any_size_are_keyed() -> None:
    """Issue 19: str(int) refuses more than 4300 digits; ints are encoded as bytes."""
    big = 7**20000
    assert key(("v", big)) == key(("v", 7**20000))
    assert len({key(("v", v)) for v in (big, big + 1, -big, big * 256)}) == 4


def test_bad_labels_and_namespaces() -> None:
    with pytest.raises(TypeError):
        KeyBuilder("")
    with pytest.raises(TypeError, match="labels must be str"):
        KeyBuilder("t").add(1, "x")  # type: ignore[arg-type]


def test_the_encoding_is_pinned() -> None:
    """The key of today's encoding (schema 2, ints as bytes since issue 19): a change of
    the encoding must bump SCHEMA_VERSION, and then this digest changes too."""
    assert make_key("x", a=1) == "2f58c3813f9a20aacd1fe9e9e76fc6af98e23fefd06c89bc4a8d48e26e385b32"


def test_the_fields_kept_for_explain_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVRTC keys hold whole sources and headers: a JIT process building many variants
    # keeps only about BUILT_MAX_BYTES of them for `kernelcache explain` (review).
    from kernelcache import keys

    monkeypatch.setattr(keys, "BUILT_MAX_BYTES", 1 << 20)
    made = [
        keys.KeyBuilder("t.big").add("source", bytes([i]) * (256 << 10)).hexdigest()
        for i in range(40)
    ]
    held = sum(len(e) for _, fields in keys._BUILT.values() for _, e in fields)  # noqa: SLF001
    assert held <= (1 << 20) + (256 << 10) + 64
    assert keys.built(made[-1]) is not None  # the newest is kept
    assert keys.built(made[0]) is None
