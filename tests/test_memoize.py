"""kernelcache.memoize: content-keyed in-process cache of unpicklable handles."""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kernelcache.memoize import CacheInfo, Memo, memoize

OFFSET = 10
CONFIG = {"block": 128}


def helper_v1(x: int) -> int:
    return x + 1


def helper_v2(x: int) -> int:
    return x + 2


helper = helper_v1


class Handle:
    """Stands in for a compiled-kernel handle: unpicklable, identity matters."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.lock = threading.Lock()  # what makes real handles unpicklable


@memoize
def uses_helper(x: int) -> Handle:
    return Handle(helper(x))


@memoize(maxsize=4)
def uses_globals(x: int) -> Handle:
    return Handle(x + OFFSET + CONFIG["block"])


def test_repeated_calls_hit_and_return_the_same_object() -> None:
    uses_helper.cache_clear()
    first = uses_helper(1)
    assert uses_helper(1) is first
    assert uses_helper(1) is first
    assert uses_helper.cache_info() == CacheInfo(hits=2, misses=1, maxsize=128, currsize=1)


def test_rebound_global_helper_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    uses_helper.cache_clear()
    assert uses_helper(1).value == 2
    monkeypatch.setattr(sys.modules[__name__], "helper", helper_v2)
    assert uses_helper(1).value == 3  # not the stale handle
    assert uses_helper.cache_info().misses == 2
    monkeypatch.setattr(sys.modules[__name__], "helper", helper_v1)
    assert uses_helper(1).value == 2
    assert uses_helper.cache_info().hits == 1  # back to v1's key: the first handle


def test_helper_with_new_code_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    uses_helper.cache_clear()
    assert uses_helper(5).value == 6
    monkeypatch.setattr(helper_v1, "__code__", helper_v2.__code__)
    assert uses_helper(5).value == 7


def test_changed_global_value_and_mutated_global_dict_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    uses_globals.cache_clear()
    assert uses_globals(1).value == 139
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 20)
    assert uses_globals(1).value == 149
    monkeypatch.setitem(CONFIG, "block", 256)  # in place: same dict object
    assert uses_globals(1).value == 277
    assert uses_globals.cache_info().misses == 3


def test_changed_closure_value_misses() -> None:
    scale = 2

    @memoize
    def build(x: int) -> Handle:
        return Handle(x * scale)

    assert build(3).value == 6
    assert build(3).value == 6
    scale = 5
    assert build(3).value == 15
    assert build.cache_info() == CacheInfo(hits=1, misses=2, maxsize=128, currsize=2)


def test_helper_defined_after_decoration_is_seen() -> None:
    @memoize
    def late(x: int) -> int:
        return later_helper(x)  # an empty closure cell when decorated

    def later_helper(x: int) -> int:
        return x * 100

    # The fingerprint is taken at the first call, not at decoration; and a
    # name bound later fails a probe, so the fingerprint is redone anyway.
    assert late(2) == 200


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32), id="shape"),
        pytest.param(np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float16), id="dtype"),
        pytest.param(np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32).T, id="strides"),
        pytest.param(1, True, id="int-vs-bool"),
        pytest.param(1, 1.0, id="int-vs-float"),
        pytest.param(0.0, -0.0, id="signed-zero"),
        pytest.param("1", b"1", id="str-vs-bytes"),
        pytest.param((1, 2), [1, 2], id="tuple-vs-list"),
        pytest.param(("a", "b"), ("ab",), id="nesting"),
        pytest.param({"k": 1}, {"k": 2}, id="dict-value"),
        pytest.param(np.float32(1.0), np.float32(2.0), id="numpy-scalar"),
        pytest.param(np.bool_(True), np.bool_(False), id="numpy-bool"),
        pytest.param(helper_v1, helper_v2, id="callables"),
        pytest.param(functools.partial(helper_v1), functools.partial(helper_v2), id="partials"),
    ],
)
def test_different_argument_structure_misses(a: Any, b: Any) -> None:
    memo = Memo()
    assert memo.call(Handle, a) is not memo.call(Handle, b)
    assert memo.cache_info().misses == 2


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(np.zeros((4, 8)), np.ones((4, 8)), id="array-contents-ignored"),
        pytest.param(float("nan"), float("nan"), id="nan"),
        pytest.param({"a": 1, "b": 2}, {"b": 2, "a": 1}, id="dict-order"),
        pytest.param(np.float32(1.0), np.float32(1.0), id="numpy-scalar"),
    ],
)
def test_same_argument_structure_hits(a: Any, b: Any) -> None:
    memo = Memo()
    assert memo.call(Handle, a) is memo.call(Handle, b)
    assert memo.cache_info().hits == 1


def test_torch_style_stride_method_and_device() -> None:
    class Tensor:
        def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], device: str) -> None:
            self.shape, self.dtype, self._stride, self.device = (
                shape,
                "torch.float16",
                stride,
                device,
            )

        def stride(self) -> tuple[int, ...]:
            return self._stride

    memo = Memo()
    a = memo.call(Handle, Tensor((4, 4), (4, 1), "cuda:0"))
    assert memo.call(Handle, Tensor((4, 4), (4, 1), "cuda:0")) is a
    assert memo.call(Handle, Tensor((4, 4), (1, 4), "cuda:0")) is not a
    assert memo.call(Handle, Tensor((4, 4), (4, 1), "cuda:1")) is not a


def test_functions_are_keyed_by_fingerprint_not_identity() -> None:
    def make(n: int) -> Any:
        def kernel() -> int:
            return n

        return kernel

    memo = Memo()
    first = memo.call(Handle, make(1))
    assert memo.call(Handle, make(1)) is first  # a new but identical closure
    assert memo.call(Handle, make(2)) is not first  # same code, other closure value


def test_explicit_memo_separates_functions() -> None:
    memo = Memo()
    assert memo.call(helper_v1, 1) == 2
    assert memo.call(helper_v2, 1) == 3
    assert memo.call(helper_v1, 1) == 2
    assert memo.cache_info() == CacheInfo(hits=1, misses=2, maxsize=128, currsize=2)


def test_lru_bound() -> None:
    uses_globals.cache_clear()
    for i in range(6):
        uses_globals(i)
    assert uses_globals.cache_info().currsize == 4
    uses_globals(5)  # most recent: still there
    uses_globals(0)  # evicted: built again
    assert uses_globals.cache_info().hits == 1
    assert uses_globals.cache_info().misses == 7


def test_maxsize_zero_caches_nothing_and_bad_maxsize_is_refused() -> None:
    memo = Memo(maxsize=0)
    assert memo.call(Handle, 1) is not memo.call(Handle, 1)
    with pytest.raises(ValueError, match="maxsize"):
        Memo(maxsize=-1)


def test_unhashable_opaque_argument_is_refused() -> None:
    class Opaque:
        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="cannot key an argument of type"):
        Memo().call(Handle, Opaque())


def test_exceptions_are_not_cached() -> None:
    # Logs live in opaque objects: a list in the closure is part of the
    # fingerprint (see test_mutated_closure_list_is_part_of_the_key).
    calls: list[int] = []
    log = Handle(calls)

    @memoize
    def flaky(x: int) -> int:
        log.value.append(x)
        if len(log.value) == 1:
            raise RuntimeError("first build fails")
        return x

    with pytest.raises(RuntimeError):
        flaky(1)
    assert flaky(1) == 1
    assert flaky(1) == 1
    assert calls == [1, 1]


def test_threads_share_one_build() -> None:
    builds: list[int] = []
    log = Handle(builds)
    start = threading.Barrier(8)

    @memoize
    def slow(x: int) -> Handle:
        log.value.append(x)
        time.sleep(0.05)
        return Handle(x)

    results: list[Handle] = []

    def worker() -> None:
        start.wait()
        for _ in range(50):
            results.append(slow(7))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert builds == [7]
    assert len(results) == 400
    assert all(r is results[0] for r in results)
    assert slow.cache_info() == CacheInfo(hits=399, misses=1, maxsize=128, currsize=1)


def test_recursion_on_the_same_key_does_not_deadlock() -> None:
    depth: list[int] = []
    log = Handle(depth)

    @memoize
    def reenter(x: int) -> int:
        log.value.append(x)
        return reenter(x) if len(log.value) < 3 else x

    assert reenter(1) == 1
    assert depth == [1, 1, 1]


def test_mutated_closure_list_is_part_of_the_key() -> None:
    table = [1]

    @memoize
    def from_table(x: int) -> int:
        return x + sum(table)

    assert from_table(0) == 1
    table.append(2)  # the fingerprint hashes container contents, so this is a change
    assert from_table(0) == 3
    assert from_table.cache_info().misses == 2


def test_a_global_of_a_helper_in_another_project_module_is_watched(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fingerprint.function follows the project's helpers in other modules; the memo's
    cheap probes must see what it reads there, or a changed helper gives a stale handle."""
    package = tmp_path / "memo_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("SCALE = 2\n\ndef scale(x):\n    return x * SCALE\n")
    (package / "kernels.py").write_text(
        "from . import helpers\n\ndef build(x):\n    return helpers.scale(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import memo_project.helpers  # type: ignore[import-not-found]
    import memo_project.kernels  # type: ignore[import-not-found]

    memo_fn = memoize(memo_project.kernels.build)
    assert memo_fn(3) == 6
    monkeypatch.setattr(memo_project.helpers, "SCALE", 5)
    assert memo_fn(3) == 15  # not the stale 6
    assert memo_fn.cache_info().misses == 2
