"""The public surface: one lazy table, a clean dir(), install hints, uniform tier constructors."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import kernelcache as kc

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
        check=False,
    )


@pytest.mark.parametrize("name", kc.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(kc, name) is not None


def test_dir_lists_the_public_names_and_nothing_else() -> None:
    assert sorted(dir(kc)) == sorted([*kc.__all__, "__version__"])
    assert "TYPE_CHECKING" not in dir(kc)
    assert "typing" not in dir(kc)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = kc.nope


def test_subpackages_work_as_the_first_access_in_a_fresh_process() -> None:
    out = run(
        "import kernelcache as kc\n"
        "print(kc.stores.DiskStore.__name__, kc.RedisStore.__name__, kc.nvrtc.compile.__name__)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DiskStore", "RedisStore", "compile"]


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        pytest.param("kernelcache.triton", "triton", "triton", id="triton"),
        pytest.param("kernelcache.cuda_core", "cuda.core", "nvrtc", id="cuda_core"),
    ],
)
def test_a_missing_extra_names_what_to_install(module: str, blocked: str, extra: str) -> None:
    # None in sys.modules makes the import fail as if the package were not installed.
    out = run(f"import sys; sys.modules[{blocked!r}] = None\nimport {module}")
    assert out.returncode != 0
    assert f"pip install 'kernelcache[{extra}]'" in out.stderr, out.stderr


def test_the_version_is_written_once() -> None:
    assert importlib.metadata.version("kernelcache") == kc.__version__


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: kc.MemoryStore(100), id="memory"),  # type: ignore[call-arg]
        pytest.param(lambda p: kc.DiskStore(p, 100), id="disk"),  # type: ignore[call-arg]
        pytest.param(lambda p: kc.SQLiteStore(p / "db", 100), id="sqlite"),  # type: ignore[call-arg]
    ],
)
def test_caps_are_keyword_only(make: object, tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        make(tmp_path)  # type: ignore[operator]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1M", True])
@pytest.mark.parametrize("cap", ["max_bytes", "max_entries"])
def test_one_rule_for_every_tiers_caps(bad: object, cap: str, tmp_path: Path) -> None:
    for make in (
        lambda **kw: kc.MemoryStore(**kw),
        lambda **kw: kc.DiskStore(tmp_path / "d", **kw),
        lambda **kw: kc.SQLiteStore(tmp_path / "db", **kw),
    ):
        with pytest.raises(ValueError, match=f"{cap} must be a positive int or None"):
            make(**{cap: bad})
