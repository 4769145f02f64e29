"""Which releases an integration installs over: a tested range, then the seams it probes.

The generic rules run over :class:`~kernelcache.integration.Integration` with
seams in the standard library; one test fakes a newer torch for the real
``kernelcache.inductor``, whose seams are then those of the torch installed.
"""

from __future__ import annotations

import types
import warnings

import pytest

from kernelcache.integration import Integration, UntestedVersionWarning
from kernelcache.patching import Patches
from kernelcache.versions import Range, decide, missing_seams, release

TARGET = types.SimpleNamespace(patched=False)


def _hook(patches: Patches) -> None:
    patches.set(TARGET, "patched", True)


def _shape(*seams: str | tuple[str, ...]) -> Integration:
    return Integration(
        "x", tool="X", tested=Range("2.10", "2.15"), seams=seams, counters=(), hook=_hook
    )


@pytest.mark.parametrize(
    ("version", "numbers"),
    [
        pytest.param("2.13.0", (2, 13, 0), id="plain"),
        pytest.param("2.13.0+cpu", (2, 13, 0), id="local-tag"),
        pytest.param("2.15.0rc1", (2, 15, 0), id="pre-release"),
        pytest.param("v0.1.15.dev3", (0, 1, 15), id="dev"),
    ],
)
def test_release_reads_the_numbers_only(version: str, numbers: tuple[int, ...]) -> None:
    assert release(version) == numbers


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        pytest.param("2.10.0", True, id="oldest"),
        pytest.param("2.15.3", True, id="a-patch-of-the-newest"),
        pytest.param("2.9.1", False, id="older"),
        pytest.param("2.16.0", False, id="newer"),
        pytest.param("2.100.0", False, id="numbers-not-strings"),
        pytest.param("3", False, id="short"),
    ],
)
def test_a_range_compares_release_numbers(version: str, inside: bool) -> None:
    assert (version in Range("2.10", "2.15")) is inside


def test_a_range_refuses_to_be_empty() -> None:
    with pytest.raises(ValueError, match=r"empty range: 2\.15 is newer than 2\.10"):
        Range("2.15", "2.10")


def test_a_seam_is_found_through_modules_and_attributes_and_alternatives() -> None:
    assert missing_seams(["json:dumps", "os.path:join", ("json:no_such", "json:loads")]) == []
    assert missing_seams(["json:dumps.no_such", "no_such_module:x", ("json:a", "json:b")]) == [
        "json:dumps.no_such",
        "no_such_module:x",
        "json:a or json:b",
    ]


def test_a_tested_release_installs_without_a_warning() -> None:
    shape = _shape("json:dumps")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shape.install("2.13.0", None, {}) is True
    assert TARGET.patched
    shape.uninstall()
    assert not TARGET.patched


def test_a_newer_release_with_every_seam_installs_and_warns_once() -> None:
    shape = _shape("json:dumps")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [shape.install("2.16.0", None, {}) for _ in range(2)]
    assert results == [True, True]
    assert [w.category for w in caught] == [UntestedVersionWarning]
    assert str(caught[0].message) == (
        "kernelcache.x: X 2.16.0 is untested (tested: 2.10 to 2.15); "
        "every seam kernelcache needs is there; installing"
    )
    assert TARGET.patched
    shape.uninstall()


def test_a_missing_seam_is_refused_with_one_line_that_names_it() -> None:
    shape = _shape("json:dumps", "json:no_such_seam")
    with pytest.warns(RuntimeWarning) as caught:
        assert shape.install("2.16.0", None, {}) is False
    assert [str(w.message) for w in caught] == [
        "kernelcache.x: X 2.16.0 lacks json:no_such_seam (tested: X 2.10 to 2.15; "
        "newest tested 2.15): X keeps its own cache"
    ]
    assert not shape.installed()
    assert not TARGET.patched


def test_a_missing_seam_is_refused_inside_the_range_too() -> None:
    assert decide("X", "2.13.0", Range("2.10", "2.15"), ["json:gone"]).status == "refused"


def test_strict_versions_refuses_every_release_outside_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERNELCACHE_STRICT_VERSIONS", "1")
    shape = _shape("json:dumps")
    with pytest.warns(
        RuntimeWarning, match=r"outside the tested 2\.10 to 2\.15 and KERNELCACHE_ST"
    ):
        assert shape.install("2.16.0", None, {}) is False
    assert not TARGET.patched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shape.install("2.15.1", None, {}) is True
    shape.uninstall()


def test_strict_versions_must_be_a_boolean(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelcache.errors import ConfigError

    monkeypatch.setenv("KERNELCACHE_STRICT_VERSIONS", "maybe")
    with pytest.raises(ConfigError, match="KERNELCACHE_STRICT_VERSIONS must be one of"):
        decide("X", "3.0", Range("1", "2"), [])


def test_inductor_installs_over_a_newer_torch_whose_seams_are_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inductor = pytest.importorskip("kernelcache.inductor")
    from kernelcache.cache import Cache
    from kernelcache.stores.memory import MemoryStore

    monkeypatch.setattr(inductor, "torch_version", lambda: "2.99.0")
    inductor.uninstall()
    try:
        with pytest.warns(UntestedVersionWarning, match=r"torch 2\.99\.0 is untested"):
            assert inductor.install(Cache([MemoryStore()], persist_stats=False)) is True
        assert inductor.installed()
    finally:
        inductor.uninstall()
    monkeypatch.setattr(inductor, "SEAMS", (*inductor.SEAMS, "torch:no_such_seam"))
    monkeypatch.setattr(inductor._state, "seams", inductor.SEAMS)  # noqa: SLF001
    with pytest.warns(RuntimeWarning, match=r"torch 2\.99\.0 lacks torch:no_such_seam"):
        assert inductor.install() is False
    assert not inductor.installed()
