"""kernelcache as ninetoothed's cache, with the real ninetoothed and Triton packages.

No GPU: the stand-in Triton driver (``triton_standin.py``) reports an sm_90
target; code generation, ``triton.tools.compile`` and nvcc all run for real.
Processes of their own run ``ninetoothed_kernels.py``.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ninetoothed = pytest.importorskip("ninetoothed")
triton = pytest.importorskip("triton")

import children  # noqa: E402
import kernelcache.ninetoothed as kcn  # noqa: E402
import ninetoothed_kernels as nk  # noqa: E402  (activates the stand-in driver)
import triton_standin  # noqa: E402
from cuda_standin import Toolkit, make_toolkit  # noqa: E402
from kernelcache.cache import Cache  # noqa: E402
from kernelcache.ninetoothed import outputs, shapes  # noqa: E402
from kernelcache.ninetoothed.handles import TensorsKey  # noqa: E402
from kernelcache.nvcc.key import ENV_VARS  # noqa: E402
from kernelcache.stores.memory import MemoryStore  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "ninetoothed_kernels.py"
H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "capability": (8, 0)}


@pytest.fixture(autouse=True)
def standin_driver() -> Iterator[None]:
    triton_standin.activate()
    yield
    triton.runtime.driver.set_active(None)  # back to "detect on first use"


@pytest.fixture
def installed() -> Iterator[None]:
    with kcn.enabled(Cache([MemoryStore()], persist_stats=False), device=H100):
        yield


# In process: the make() memo --------------------------------------------------
def _misses() -> int:
    return kcn.stats()["make_misses"]


def _base(**changes: Any) -> dict[str, Any]:
    return {
        "arrangement": nk.arrangement,
        "application": nk.application,
        "tensors": nk.tensors(),
    } | changes


VARIANTS = [
    pytest.param(
        {"arrangement": functools.partial(nk.arrangement, block=512)}, id="arrangement-partial-arg"
    ),
    pytest.param({"arrangement": nk.arrangement_closing_over(512)}, id="arrangement-closure"),
    pytest.param({"application": nk.application_minus}, id="application-source"),
    pytest.param(
        {"tensors": tuple(ninetoothed.Tensor(shape=(4096,)) for _ in range(3))}, id="fixed-shape"
    ),
    pytest.param({"tensors": nk.tensors(ninetoothed.float16)}, id="dtype"),
    pytest.param({"tensors": tuple(ninetoothed.Tensor(1, other=0) for _ in range(3))}, id="other"),
    pytest.param({"kernel_name": "renamed"}, id="kernel-name"),
    pytest.param({"num_warps": 8}, id="num-warps"),
    pytest.param({"num_stages": 3}, id="num-stages"),
    pytest.param({"max_num_configs": 2}, id="max-num-configs"),
]


def _make(call: dict[str, Any]) -> Any:
    call = dict(call)
    return ninetoothed.make(
        call.pop("arrangement"), call.pop("application"), call.pop("tensors"), **call
    )


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("variant", VARIANTS)
def test_make_memo_misses_on_each_key_field(variant: dict[str, Any]) -> None:
    base = _make(_base())
    assert _make(_base()) is base, "equal arguments, freshly made tensors: a hit"
    misses = _misses()
    other = _make(_base(**variant))
    assert _misses() == misses + 1
    assert other is not base
    assert _make(_base(**variant)) is other


@pytest.mark.usefixtures("installed")
def test_make_memo_keys_non_tensor_elements_like_ceil_mode() -> None:
    # ninetoothed #161: same shapes, ceil_mode as the tensors tuple's last element.
    def call(ceil_mode: bool) -> Any:
        return ninetoothed.make(
            nk.arrangement_with_flag, nk.application, (*nk.tensors(), ceil_mode)
        )

    floor, ceil = call(False), call(True)
    assert floor is not ceil
    assert call(False) is floor
    assert call(True) is ceil
    assert kcn.stats()["make_misses"] == 2


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            {"constexpr": True, "value": 2}, {"constexpr": True, "value": 3}, id="constexpr-value"
        ),
        pytest.param({"constexpr": True, "value": 2}, {"constexpr": None}, id="constexpr-flag"),
    ],
)
def test_zero_dim_tensor_signature(a: dict[str, Any], b: dict[str, Any]) -> None:
    def key(options: dict[str, Any]) -> TensorsKey:
        return TensorsKey((*nk.tensors(), ninetoothed.Tensor(0, **options)))

    assert key(a) == key(a)
    assert hash(key(a)) == hash(key(a))
    assert key(a) != key(b)


def test_uninstall_restores_make_and_caches() -> None:
    before = (ninetoothed.make, ninetoothed.build, os.environ.get("TRITON_CACHE_MANAGER"))
    with kcn.enabled(Cache([MemoryStore()], persist_stats=False)):
        assert ninetoothed.make is not before[0]
        assert os.environ["TRITON_CACHE_MANAGER"] == kcn.TRITON_CACHE_MANAGER
    assert (ninetoothed.make, ninetoothed.build, os.environ.get("TRITON_CACHE_MANAGER")) == before


def test_a_release_without_a_seam_keeps_ninetoothed_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kcn, "_ninetoothed_version", lambda: "0.27.0")
    monkeypatch.setattr(kcn._state, "seams", (*kcn.SEAMS, "ninetoothed.make:gone"))  # noqa: SLF001
    with pytest.warns(RuntimeWarning, match="lacks ninetoothed.make:gone .*keeps its own caches"):
        assert kcn.install() is False
    assert not kcn.installed()


def test_generated_source_changes_with_the_application() -> None:
    # What upstream's build fingerprint misses: premake unchanged, application edited.
    def source(application: Any, counter: int) -> str:
        # Tensors are named from ninetoothed's process-wide counter, and its generator orders
        # parameters by name as strings: "tensor_10" < "tensor_9". The key renumbers names
        # (outputs.normalized) but cannot reorder, so it is the same across processes while a
        # kernel's tensor numbers have as many digits each (a straddle is a spurious miss).
        ninetoothed.Tensor.num_instances = counter
        return outputs.application_source(
            nk.arrangement, application, nk.tensors(ninetoothed.float32),
            caller="cuda", kernel_name="k", num_warps=4, num_stages=1,
        )  # fmt: skip

    assert source(nk.application, 100) == source(nk.application, 500)
    assert source(nk.application, 100) != source(nk.application_minus, 100)


@pytest.mark.parametrize(
    ("name", "value"),
    [("NVCC_APPEND_FLAGS", "-G"), ("NVCC_PREPEND_FLAGS", "--use_fast_math"), ("CPATH", "/opt/x")],
)
def test_the_environment_nvcc_reads_is_keyed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    """The AOT outputs' key changes with what nvcc reads besides its command line."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    plain = outputs.output_key("aot", tmp_path, kernel_name="add")
    monkeypatch.setenv(name, value)
    assert outputs.output_key("aot", tmp_path, kernel_name="add") != plain


# In process: seams whose shape moved (kernelcache.ninetoothed.shapes) ----------
def test_build_gets_only_the_keywords_it_takes() -> None:
    def build_0_24(
        premake: Any, configs: Any, *, caller: Any = None, output_dir: Any = None
    ) -> None:
        """ninetoothed 0.24's build(): no meta_parameters, no lazy."""

    kept = shapes.build_kwargs(build_0_24, caller="cuda", meta_parameters=None, lazy=False)
    assert kept == {"caller": "cuda"}
    with pytest.raises(TypeError, match="takes no 'meta_parameters'"):
        shapes.build_kwargs(build_0_24, meta_parameters=("block",))


def test_config_values_are_named_as_the_installed_build_names_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ninetoothed import aot

    assert shapes.name_value(512) == 512
    if hasattr(importlib.import_module("ninetoothed.build"), "_arg_to_int"):  # 0.25+
        assert shapes.name_value(True) == 1
    # 0.24's rule (no _arg_to_int): booleans as macros, dtypes as their C names.
    monkeypatch.setattr(shapes, "ARG_TO_INT", ("ninetoothed.build", "_gone"))
    assert shapes.name_value(True) == aot._MACRO_MAPPING[True][0]  # noqa: SLF001
    float32 = ninetoothed.float32
    assert shapes.name_value(float32) == aot._DTYPE_MAPPING[float32]  # noqa: SLF001
    assert shapes.name_value(512) == 512


def test_ninetootheds_code_is_in_every_output_key(tmp_path: Path) -> None:
    """Two ninetoothed releases never share an output entry: its code is a key field
    (a copy of the package keys the same; one byte changed in aot.py does not)."""
    package = Path(ninetoothed.__file__).parent
    copy = tmp_path / "ninetoothed"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    key = outputs.output_key("aot", tmp_path, kernel_name="add")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ninetoothed, "__file__", str(copy / "__init__.py"))
        assert outputs.output_key("aot", tmp_path, kernel_name="add") == key
        with (copy / "aot.py").open("a") as f:
            f.write("\n# another release\n")
        assert outputs.output_key("aot", tmp_path, kernel_name="add") != key


# In process: the auto-tuner ---------------------------------------------------
def test_autotune_timings_are_shared_per_gpu_model() -> None:
    import torch
    from ninetoothed.auto_tuner import AutoTuner

    benched: list[str] = []

    def bench(fn: Any) -> float:
        return float(fn())

    def candidate(name: str, latency: float) -> Any:
        def run(x: Any) -> float:
            benched.append(name)
            return latency

        return run

    def tune(device: dict[str, Any]) -> float:
        with kcn.enabled(Cache([cache_tier], persist_stats=False), device=device, bench=bench):
            tuner = AutoTuner(
                [candidate("slow", 2.0), candidate("fast", 1.0)], ["cfg-slow", "cfg-fast"]
            )
            return float(tuner(torch.zeros(8)))

    cache_tier = MemoryStore()
    assert tune(H100) == 1.0
    assert benched == ["slow", "fast", "fast"]  # two timings, one call
    benched.clear()
    assert tune(H100) == 1.0
    assert benched == ["fast"], "same GPU model: the record, no re-tuning"
    benched.clear()
    assert tune(A100) == 1.0
    assert benched == ["slow", "fast", "fast"], "another model tunes anew"


# Processes: the source race, build and AOT outputs -----------------------------
@pytest.fixture(scope="module")
def toolkit(tmp_path_factory: pytest.TempPathFactory) -> Toolkit:
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("needs nvcc (the compiles are real)")
    return make_toolkit(tmp_path_factory.mktemp("standin"))


@pytest.fixture
def nt_env(toolkit: Toolkit, tmp_path: Path) -> dict[str, str]:
    toolkit.reset()
    env = toolkit.env()
    home = tmp_path / "home"
    home.mkdir()
    env["HOME"] = str(home)  # ninetoothed's ~/.ninetoothed
    env["KERNELCACHE_DIR"] = str(tmp_path / "kc")
    # ninetoothed runs `python -m triton.tools.compile`: this interpreter's, with the stand-in driver.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "standin_site"), str(ROOT / "src"), str(HERE)])
    env.pop("TRITON_CACHE_MANAGER", None)
    return env


def test_source_race_has_no_failures(nt_env: dict[str, str], tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [
        children.start(SCRIPT, nt_env, "race", "200", "t", "--wait-for", str(go)) for _ in range(2)
    ]
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("go.ready.*"))) < 2:
        assert time.monotonic() < deadline
        assert all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()
    reports = [children.finish(p) for p in procs]
    assert sum(r["count"] for r in reports) >= 400
    assert [r["failures"] for r in reports] == [0, 0], [r["errors"] for r in reports]


def test_aot_outputs_are_reused_by_a_second_process(
    toolkit: Toolkit, nt_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = children.finish(children.start(SCRIPT, nt_env, "aot", str(out)))
    assert first["stats"]["output_compiles"] == 1
    assert len(toolkit.compiles()) == 1
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "add.so" in files
    assert "add.h" in files
    shutil.rmtree(out)  # a fresh checkout: the outputs are gone, kernelcache has them
    runs = len(toolkit.runs())
    second = children.finish(children.start(SCRIPT, nt_env, "aot", str(out)))
    assert second["stats"]["output_hits"] == 1
    assert second["stats"]["output_compiles"] == 0
    assert len(toolkit.runs()) == runs, "no nvcc run on a hit"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


@pytest.mark.slow
def test_build_outputs_are_reused_by_a_second_process(
    toolkit: Toolkit, nt_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = children.finish(children.start(SCRIPT, nt_env, "build", str(out)))
    assert first["stats"]["output_compiles"] == 1
    compiles = len(toolkit.compiles())
    assert compiles == 3  # one library per config and the dispatcher
    shutil.rmtree(out)
    second = children.finish(children.start(SCRIPT, nt_env, "build", str(out)))
    assert second["stats"]["output_hits"] == 1
    assert second["stats"]["output_compiles"] == 0
    assert len(toolkit.compiles()) == compiles
    assert (out / "add.so").is_file()
    if hasattr(importlib.import_module("ninetoothed.build"), "_fingerprint_path"):  # 0.26+
        assert (out / "add.fingerprint").is_file()  # restored whole, as upstream wrote it
