"""Fingerprints: what changes behaviour changes the fingerprint; nothing else does."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from kernelcache import fingerprint

_counter = itertools.count()

BASE = """
import functools
SCALE = 2

def helper(x):
    return x * SCALE

def kernel(x, n=3):
    return helper(x) + n
"""


def load(tmp_path: Path, source: str) -> ModuleType:
    """Import ``source`` as a real module file (so inspect.getsource works as for users)."""
    name = f"fp_mod_{next(_counter)}"
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fp_of(tmp_path: Path, source: str, attr: str = "kernel") -> str:
    return fingerprint.function(getattr(load(tmp_path, source), attr))


MUST_DIFFER = [
    pytest.param(BASE.replace("x * SCALE", "x * SCALE + 1"), id="global-helper-body"),
    pytest.param(BASE.replace("SCALE = 2", "SCALE = 3"), id="global-constant"),
    pytest.param(BASE.replace("n=3", "n=4"), id="default-value"),
    pytest.param(BASE.replace("+ n", "- n"), id="own-body"),
    pytest.param(
        BASE
        + "\ndef make(k):\n    def kernel(x):\n        return x + k\n    return kernel\nkernel = make(1)\n",
        id="closure-vs-plain",
    ),
]


@pytest.mark.parametrize("changed", MUST_DIFFER)
def test_changes_that_must_miss(tmp_path: Path, changed: str) -> None:
    assert fp_of(tmp_path, BASE) != fp_of(tmp_path, changed)


CLOSURE = """
def make(k):
    def kernel(x):
        return x + k
    return kernel
"""


def test_closure_value_changes_fingerprint(tmp_path: Path) -> None:
    module = load(tmp_path, CLOSURE)
    assert fingerprint.function(module.make(1)) != fingerprint.function(module.make(2))
    assert fingerprint.function(module.make(1)) == fingerprint.function(module.make(1))


def test_partial_args_and_kwargs(tmp_path: Path) -> None:
    module = load(tmp_path, BASE)
    base = fingerprint.function(functools.partial(module.kernel, n=1))
    assert base == fingerprint.function(functools.partial(module.kernel, n=1))
    assert base != fingerprint.function(functools.partial(module.kernel, n=2))
    assert base != fingerprint.function(functools.partial(module.kernel, 1))
    nested = functools.partial(functools.partial(module.kernel, n=1), 5)
    assert fingerprint.function(nested) != base


def test_recursive_helpers_terminate(tmp_path: Path) -> None:
    source = """
def ping(n):
    return pong(n - 1) if n else 0

def pong(n):
    return ping(n - 1) if n else 1
"""
    first = fp_of(tmp_path, source, "ping")
    assert first == fp_of(tmp_path, source, "ping")
    assert first != fp_of(tmp_path, source.replace("else 1", "else 2"), "ping")


def test_unrelated_module_content_does_not_matter(tmp_path: Path) -> None:
    extra = BASE + "\ndef unrelated():\n    return 42\nOTHER = [1, 2, 3]\n"
    assert fp_of(tmp_path, BASE) == fp_of(tmp_path, extra)


def test_builtins_and_functions_without_source_are_stable() -> None:
    assert fingerprint.function(len) == fingerprint.function(len)
    assert fingerprint.function(len) != fingerprint.function(max)
    namespace: dict[str, object] = {}
    exec("def f(x):\n    return x + 1\n", namespace)
    exec("def g(x):\n    return x + 2\n", namespace)
    f, g = namespace["f"], namespace["g"]
    assert callable(f)
    assert callable(g)
    assert fingerprint.function(f) != fingerprint.function(g)


def test_same_function_in_another_process_agrees(tmp_path: Path) -> None:
    module = load(tmp_path, BASE)
    here = fingerprint.function(module.kernel)
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        from kernelcache import fingerprint
        spec = importlib.util.spec_from_file_location({module.__name__!r}, {module.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(fingerprint.function(module.kernel))
        """
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # a different hash seed must not matter
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == here


def test_files_by_content_and_relative_name(tmp_path: Path) -> None:
    for project in ("a", "b"):
        (tmp_path / project / "inc").mkdir(parents=True)
        (tmp_path / project / "inc" / "h.cuh").write_text("#define N 4\n")
        (tmp_path / project / "k.cu").write_text("__global__ void k() {}\n")
    a, b = tmp_path / "a", tmp_path / "b"
    fa = fingerprint.files([a / "k.cu", a / "inc" / "h.cuh"], root=a)
    # Another checkout of the same project, listed in another order: same fingerprint.
    assert fa == fingerprint.files([b / "inc" / "h.cuh", b / "k.cu"], root=b)
    os.utime(b / "k.cu", (0, 0))  # mtimes never matter
    assert fa == fingerprint.files([b / "k.cu", b / "inc" / "h.cuh"], root=b)
    (b / "inc" / "h.cuh").write_text("#define N 8\n")
    assert fa != fingerprint.files([b / "k.cu", b / "inc" / "h.cuh"], root=b)
    # The same content under another relative name differs.
    assert fingerprint.files([a / "k.cu"], root=a) != fingerprint.files([a / "k.cu"], root=tmp_path)


def test_env_distinguishes_unset_from_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KC_TEST_VAR", raising=False)
    unset = fingerprint.env(["KC_TEST_VAR"])
    monkeypatch.setenv("KC_TEST_VAR", "")
    empty = fingerprint.env(["KC_TEST_VAR"])
    monkeypatch.setenv("KC_TEST_VAR", "1")
    one = fingerprint.env(["KC_TEST_VAR"])
    assert len({unset, empty, one}) == 3
    assert fingerprint.env(["KC_TEST_VAR", "KC_TEST_VAR"]) == one


def test_two_lambdas_on_one_line_differ(tmp_path: Path) -> None:
    """Their source line is the same; their code is not."""
    module = load(tmp_path, "add, mul = (lambda x: x + 1), (lambda x: x * 2)\n")
    assert fingerprint.function(module.add) != fingerprint.function(module.mul)
    same = load(tmp_path, "f, g = (lambda x: x + 1), (lambda x: x + 1)\n")
    assert fingerprint.function(same.f) == fingerprint.function(same.g)  # truly the same


HELPERS = "SCALE = 2\n\ndef scale(x):\n    return x * SCALE\n"
KERNELS = """
from . import helpers
from .helpers import scale

def by_name(x):
    return scale(x) + 1

def by_module(x):
    return helpers.scale(x) + 1
"""


def project_fingerprints(tmp_path: Path, helpers: str) -> tuple[str, str]:
    """Fingerprints of kernels in package ``fp_project`` whose helpers module holds
    ``helpers`` (each call: a new checkout, imported afresh under the same name)."""
    root = tmp_path / f"checkout{next(_counter)}"
    (root / "fp_project").mkdir(parents=True)
    (root / "fp_project" / "__init__.py").write_text("")
    (root / "fp_project" / "helpers.py").write_text(helpers)
    (root / "fp_project" / "kernels.py").write_text(KERNELS)
    sys.path.insert(0, str(root))
    try:
        kernels = importlib.import_module("fp_project.kernels")
        return fingerprint.function(kernels.by_name), fingerprint.function(kernels.by_module)
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.split(".")[0] == "fp_project"]:
            del sys.modules[name]


@pytest.mark.parametrize(
    "edited",
    [
        pytest.param(HELPERS.replace("x * SCALE", "x * SCALE + 1"), id="helper-body"),
        pytest.param(HELPERS.replace("SCALE = 2", "SCALE = 3"), id="helper-global"),
    ],
)
def test_edits_to_a_helper_in_another_module_of_the_project_count(
    tmp_path: Path, edited: str
) -> None:
    before = project_fingerprints(tmp_path, HELPERS)
    assert project_fingerprints(tmp_path, HELPERS) == before  # another checkout agrees
    after = project_fingerprints(tmp_path, edited)
    assert before[0] != after[0]  # from .helpers import scale
    assert before[1] != after[1]  # helpers.scale(...)


def test_installed_libraries_are_named_not_followed() -> None:
    import json

    def uses_a_library(x: object) -> str:
        return json.dumps(x)

    assert fingerprint.same_project(json, fingerprint.project_root(uses_a_library)) is False
    assert fingerprint.same_project(json.dumps, fingerprint.project_root(uses_a_library)) is False


def test_files_without_root_keep_same_named_files_apart(tmp_path: Path) -> None:
    """a/x.h and b/x.h swapping contents used to give the same digest (both named x.h)."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    one, two = tmp_path / "a" / "x.h", tmp_path / "b" / "x.h"
    one.write_text("#define N 1\n")
    two.write_text("#define N 2\n")
    before = fingerprint.files([one, two])
    one.write_text("#define N 2\n")
    two.write_text("#define N 1\n")
    assert fingerprint.files([one, two]) != before
    # Still independent of where the files are: the same tree elsewhere agrees.
    other = tmp_path / "copy"
    for folder, text in (("a", "#define N 2\n"), ("b", "#define N 1\n")):
        (other / folder).mkdir(parents=True)
        (other / folder / "x.h").write_text(text)
    assert fingerprint.files([other / "a" / "x.h", other / "b" / "x.h"]) == fingerprint.files(
        [one, two]
    )
