"""The shape every ``install()``/``uninstall()``/``enabled()`` integration shares.

Run over each integration whose tool is installed here (TileLang, ninetoothed),
and over :class:`kernelcache.integration.Integration` and the reversible
patches on their own.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kernelcache.cache import Cache
from kernelcache.integration import Counters, Integration
from kernelcache.patching import Patches
from kernelcache.stores.memory import MemoryStore
from kernelcache.versions import Range


def _module(name: str) -> Any:
    pytest.importorskip(name)
    if name == "ninetoothed":
        pytest.importorskip("triton")
    return importlib.import_module(f"kernelcache.{name}")


@pytest.fixture(params=["tilelang", "ninetoothed"])
def integration(request: pytest.FixtureRequest) -> Iterator[Any]:
    module = _module(request.param)
    module.uninstall()
    yield module
    module.uninstall()


def _cache() -> Cache:
    return Cache([MemoryStore()], persist_stats=False)


def test_nested_enabled_inside_install_gives_the_outer_cache_back(integration: Any) -> None:
    # Issue 19, item 10: the inner block used to leave its cache B installed.
    a, b = _cache(), _cache()
    assert integration.install(a) is True
    with integration.enabled(b) as done:
        assert done is True
        assert integration.get_cache() is b
    assert integration.installed()
    assert integration.get_cache() is a


def test_nested_enabled_restores_each_level(integration: Any) -> None:
    a, b = _cache(), _cache()
    with integration.enabled(a):
        with integration.enabled(b):
            assert integration.get_cache() is b
        assert integration.installed()
        assert integration.get_cache() is a
    assert not integration.installed()


def test_an_uninstall_inside_the_block_is_undone_at_its_end(integration: Any) -> None:
    a = _cache()
    integration.install(a)
    with integration.enabled(_cache()):
        integration.uninstall()
        assert not integration.installed()
    assert integration.installed()
    assert integration.get_cache() is a


def test_counters_refuse_an_unknown_name() -> None:
    counters = Counters(("hits",))
    counters.count("hits")
    with pytest.raises(KeyError, match="no counter 'hit'"):
        counters.count("hit")
    assert counters.snapshot() == {"hits": 1}


def test_a_hook_that_fails_half_way_leaves_nothing_patched() -> None:
    target = types.SimpleNamespace(f=1)

    def hook(patches: Patches) -> None:
        patches.set(target, "f", 2)
        raise RuntimeError("seam moved")

    shape = Integration("x", tool="X", tested=Range("1", "1"), seams=(), counters=(), hook=hook)
    with pytest.raises(RuntimeError, match="seam moved"):
        shape.install("1", None, {})
    assert target.f == 1
    assert not shape.installed()


def _never(patches: Patches) -> None:
    pytest.fail("an unsupported version was patched")


def test_derived_objects_are_rebuilt_after_a_new_cache() -> None:
    shape = Integration(
        "x", tool="X", tested=Range("1", "1"), seams=(), counters=(), hook=lambda p: None
    )
    shape.install("1", _cache(), {"device": "d"})
    first = shape.derived("records", object)
    assert shape.derived("records", object) is first
    assert shape.option("device") == "d"
    shape.install("1", _cache(), {})
    assert shape.derived("records", object) is not first
    assert shape.option("device") is None


@pytest.mark.parametrize("before", [None, "theirs"], ids=["absent", "set"])
def test_setenv_restores_the_value_or_its_absence(
    before: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if before is None:
        monkeypatch.delenv("KC_TEST_VAR", raising=False)
    else:
        monkeypatch.setenv("KC_TEST_VAR", before)
    patches = Patches()
    patches.setenv("KC_TEST_VAR", "ours")
    assert os.environ["KC_TEST_VAR"] == "ours"
    patches.restore()
    assert os.environ.get("KC_TEST_VAR") == before
