"""kernelcache.tilelang in process: key fields, the version pin, install/uninstall, autotune records."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

tilelang = pytest.importorskip("tilelang")

import kernelcache.tilelang as kct  # noqa: E402
from kernelcache.cache import Cache  # noqa: E402
from kernelcache.nvcc import key as nvcc_key  # noqa: E402
from kernelcache.stores.disk import DiskStore  # noqa: E402
from kernelcache.tilelang import keys, recording, shapes  # noqa: E402
from kernelcache.tilelang.autotune import TunerHooks  # noqa: E402

BASE: dict[str, Any] = {
    "upstream": "u" * 64,
    "backend": "tvm_ffi",
    "target": "cuda -arch=sm_90",
    "version": "0.1.15",
    "libraries": {"libtilelang.so": "1"},
    "headers": {"templates": "t", "cutlass": "c"},
    "compilers": {"nvcc": "nvcc 13.0", "host": "g++ 12", "nvrtc": None},
    "environment": {},
}


def _key(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> str:
    fields = {**BASE, **changes}
    monkeypatch.setattr(tilelang, "__version__", fields["version"])
    monkeypatch.setattr(keys, "library_stamp", lambda: fields["libraries"])
    monkeypatch.setattr(keys, "headers", lambda: fields["headers"])
    monkeypatch.setattr(keys, "compilers", lambda backend: fields["compilers"])
    for name in nvcc_key.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in fields["environment"].items():
        monkeypatch.setenv(name, value)
    return keys.kernel_key(fields["upstream"], fields["backend"], fields["target"])


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"upstream": "v" * 64}, id="upstream-key"),
        pytest.param({"backend": "cython"}, id="backend"),
        pytest.param({"target": "cuda -arch=sm_90a"}, id="target"),
        pytest.param({"version": "0.1.16"}, id="tilelang-version"),
        pytest.param({"libraries": {"libtilelang.so": "2"}}, id="library-stamp"),
        pytest.param({"headers": {"templates": "t2", "cutlass": "c"}}, id="template-headers"),
        pytest.param({"headers": {"templates": "t", "cutlass": "c2"}}, id="cutlass-headers"),
        pytest.param({"compilers": {**BASE["compilers"], "nvcc": "nvcc 13.1"}}, id="nvcc"),
        pytest.param({"compilers": {**BASE["compilers"], "host": "g++ 13"}}, id="host-compiler"),
        pytest.param({"compilers": {**BASE["compilers"], "nvrtc": "nvrtc 13.0"}}, id="nvrtc"),
        # What nvcc and the gcc it runs read besides the command line.
        pytest.param({"environment": {"NVCC_APPEND_FLAGS": "-G"}}, id="NVCC_APPEND_FLAGS"),
        pytest.param({"environment": {"NVCC_PREPEND_FLAGS": "-lineinfo"}}, id="NVCC_PREPEND"),
        pytest.param({"environment": {"CPATH": "/opt/include"}}, id="CPATH"),
        pytest.param({"environment": {"CPLUS_INCLUDE_PATH": "/opt/include"}}, id="CPLUS_PATH"),
    ],
)
def test_each_field_changes_the_key(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any]
) -> None:
    assert _key(monkeypatch, **changes) != _key(monkeypatch)


def test_same_inputs_same_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _key(monkeypatch) == _key(monkeypatch)


def test_real_probes_name_nvrtc_only_for_the_nvrtc_backend() -> None:
    assert keys.compilers("tvm_ffi")["nvrtc"] is None
    assert keys.compilers("nvrtc")["nvrtc"]
    probes = keys.compilers("tvm_ffi")
    assert probes["nvcc"]
    assert probes["host"]
    for value in [*probes.values(), *keys.headers().values(), *keys.library_stamp().values()]:
        assert value is None or "/" not in str(value).split("\n")[0], "no paths in key fields"


def test_a_release_without_a_seam_keeps_tilelangs_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tilelang, "__version__", "0.1.16")
    monkeypatch.setattr(kct._state, "seams", (*kct.SEAMS, "tilelang.cache:gone"))  # noqa: SLF001
    with pytest.warns(RuntimeWarning, match="lacks tilelang.cache:gone .*keeps its own cache"):
        assert kct.install() is False
    assert not kct.installed()


def test_strict_versions_refuse_an_untested_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tilelang, "__version__", "0.1.12")
    monkeypatch.setenv("KERNELCACHE_STRICT_VERSIONS", "1")
    with pytest.warns(RuntimeWarning, match="outside the tested 0.1.13 to 0.1.15"):
        assert kct.install() is False
    assert not kct.installed()


def test_install_and_uninstall_patch_every_backend_and_restore(tmp_path: Path) -> None:
    dispatch = getattr(importlib.import_module("tilelang.cache"), kct.DISPATCH_MAP)
    before = {name: dict(vars(upstream)) for name, upstream in dispatch.items()}
    with kct.enabled(Cache([DiskStore(tmp_path)])) as on:
        assert on
        assert kct.installed()
        for upstream in dispatch.values():
            assert kct.LOAD in vars(upstream)
            assert kct.SAVE in vars(upstream)
    assert not kct.installed()
    assert {name: dict(vars(upstream)) for name, upstream in dispatch.items()} == before


def add_for_tuning(block: int = 64) -> Any:
    import tilelang_kernels

    return tilelang_kernels.add(block=block)


def test_autotune_records_are_keyed_by_gpu_model(tmp_path: Path) -> None:
    from tilelang.autotuner.param import AutotuneResult
    from tilelang.autotuner.tuner import AutoTuner

    from tilelang_kernels import ADD_TARGET

    h100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "capability": (8, 0)}
    cache = Cache([DiskStore(tmp_path / "kc")])
    with kct.enabled(cache, device=h100):
        tuner = AutoTuner.from_kernel(
            kernel=add_for_tuning, configs=[{"block": 64}, {"block": 128}]
        )
        tuner.set_compile_args(out_idx=[2], target=ADD_TARGET, execution_backend="tvm_ffi")
        hooks = TunerHooks(kct.get_records, lambda: h100)
        hooks.save(tuner, "tuning-key", AutotuneResult(config={"block": 128}, latency=0.25))

        found = hooks.load(tuner, "tuning-key")
        assert found is not None
        assert (found.config, found.latency, found.ref_latency) == ({"block": 128}, 0.25, None)
        assert type(found.kernel).__name__ == "JITKernel"
        assert "128" in found.libcode  # the best config's kernel, compiled through the kernel cache
        assert TunerHooks(kct.get_records, lambda: a100).load(tuner, "tuning-key") is None
        assert hooks.load(tuner, "another-key") is None
    # The compile's header manifest is recorded in a background thread: done before the
    # next test patches what it reads (keys._env_module).
    recording.wait()


def test_libraries_are_named_by_build_id_else_by_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: the linker's digest names a library (no 100 MB hash in a first run); a
    relinked library with other code changes the field, one without a build ID is hashed."""
    import shutil
    import subprocess
    import types

    if shutil.which("g++") is None:
        pytest.skip("needs g++ to link libraries")

    def link(body: str, *flags: str) -> None:
        source = tmp_path / "lib.cpp"
        source.write_text(f'extern "C" int value() {{ return {body}; }}\n')
        out = tmp_path / "libtilelang.so"
        subprocess.run(["g++", "-shared", "-fPIC", *flags, "-o", str(out), str(source)], check=True)

    monkeypatch.setattr(keys, "_env_module", lambda: types.SimpleNamespace(TL_LIBS=[str(tmp_path)]))

    def stamp() -> str:
        keys.library_stamp.cache_clear()  # once per process otherwise
        try:
            return keys.library_stamp()["libtilelang.so"]
        finally:
            keys.library_stamp.cache_clear()

    link("1")
    first = stamp()
    assert first.startswith("build-id:")
    link("2")
    assert stamp() not in (first, None)
    link("2", "-Wl,--build-id=none")
    hashed = stamp()
    assert len(hashed) == 64  # the content's SHA-256
    assert int(hashed, 16) >= 0


# Seams whose shape moved between releases (kernelcache.tilelang.shapes) -------------
def _params() -> list[Any]:
    from tilelang import tvm
    from tilelang.engine.param import KernelParam, Var

    n = Var("n", "int32")
    return [
        KernelParam(tvm.DataType("float16"), [n, 128]),
        KernelParam(tvm.DataType("float32"), [n]),
        KernelParam(tvm.DataType("int32"), []),
    ]


def test_kernel_params_round_trip_as_json_on_every_release() -> None:
    """0.1.13 and 0.1.14 pickle params; entries hold JSON, written by kernelcache's own
    reflection where TileLang has no dump_kernel_params: sizes, dtypes and a symbolic
    size shared by two params survive, and no pickle is involved."""
    from tilelang.engine import param

    params = _params()
    text = shapes._dump_params(params)  # noqa: SLF001 - the fallback itself, on any release
    assert text.lstrip().startswith("{"), "JSON text, not a pickle"
    if hasattr(param, "dump_kernel_params"):  # 0.1.15: the same text as upstream's
        assert text == param.dump_kernel_params(params)
    back = shapes._load_params(text)  # noqa: SLF001
    assert [str(p.dtype) for p in back] == ["float16", "float32", "int32"]
    assert back[0].shape[1] == 128
    assert back[2].shape == []
    assert back[0].shape[0].same_as(back[1].shape[0]), "one Var, shared"
    assert shapes.load_params(shapes.dump_params(params))[0].shape[1] == 128


def test_the_load_hook_matches_the_installed_loaders_shape(tmp_path: Path) -> None:
    dispatch = getattr(importlib.import_module("tilelang.cache"), kct.DISPATCH_MAP)
    shapes_before = {shapes.takes_context(getattr(u, kct.LOAD)) for u in dispatch.values()}
    assert len(shapes_before) == 1, "every backend's loader has one shape"
    with kct.enabled(Cache([DiskStore(tmp_path)])):
        for upstream in dispatch.values():
            hook = getattr(upstream, kct.LOAD)
            expected = "load" if shapes_before == {True} else "load_separate"
            assert hook.__name__ == expected


def test_a_separate_target_reads_as_a_context() -> None:
    context = shapes.Separate.of("cuda", None, "cython")
    assert (context.target, context.execution_backend.name) == ("cuda", "cython")
    assert shapes.context_kwargs(context) == {}
    real = object()
    assert shapes.context_kwargs(real) == {"backend_context": real}


def test_the_separate_loader_gives_other_targets_to_tilelang_unchanged() -> None:
    """0.1.13's loader shape: a target kernelcache does not handle (LLVM) reaches
    TileLang's own loader with exactly the arguments TileLang passed."""
    from tilelang import tvm

    from kernelcache.integration import Counters
    from kernelcache.tilelang.kernels import COUNTERS, BackendHooks

    seen: list[tuple[Any, ...]] = []

    def original_load(*args: Any) -> str:
        seen.append(args)
        return "TileLang's own"

    counters = Counters(COUNTERS)
    hooks = BackendHooks(None, original_load, original_load, Cache, counters)
    args: tuple[Any, ...] = (
        "key",
        tvm.target.Target("llvm"),
        None,
        [2],
        "cython",
        {},
        None,
        "func",
        False,
    )
    assert hooks.load_separate(*args) == "TileLang's own"
    assert seen == [args]
    assert counters.snapshot()["passed_through"] == 1
