"""``kernelcache explain --last-miss`` for Triton and JAX, whose keys hold the tool's own hash:
the parts that hash was made of are noted with each entry, so one real change is named by its
field, and only that field (issue 38)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest

from cli_run import kc_json
from kernelcache.explain import fields, words
from kernelcache.keys import KeyBuilder


def _only_difference(kc_dir: Path, kind: str) -> dict[str, Any]:
    report: dict[str, Any] = kc_json(
        "explain", "--last-miss", kind, env={"KERNELCACHE_DIR": str(kc_dir)}
    )
    assert report["status"] == "miss", report
    near = report["nearest"][0]
    assert near["differing"] == 1, near
    difference: dict[str, Any] = near["differences"][0]
    return difference


# Triton ------------------------------------------------------------------------------------


def test_triton_last_miss_names_the_option_that_changed(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from test_triton import _finish, _kc_env, _start

    kc_dir = tmp_path / "kc"
    for warps in (4, 8):
        env = _kc_env(tmp_path, kc_dir, KC_TEST_TRITON_OPTIONS=json.dumps({"num_warps": warps}))
        assert _finish(_start(env, ["add"]))["add"]["cache_hit"] is False
    difference = _only_difference(kc_dir, "triton")
    assert difference["label"] == "options.num_warps"
    assert difference["words"] == "`options.num_warps`: 4 → 8"


def test_triton_parts_are_noted_only_from_the_compile_that_made_the_hash() -> None:
    pytest.importorskip("triton")
    from kernelcache.triton.explain import compile_parts

    assert compile_parts("A" * 52, inspect.currentframe()) is None  # no triton.compile below


def test_a_triton_compile_from_an_ir_file_notes_its_hash_as_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    import triton

    import kernelcache.triton as kt
    import triton_kernels
    from kernelcache import Cache, DiskStore

    for name in [n for n in os.environ if n.startswith(("TRITON_", "KERNELCACHE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "kernelcache.triton:CacheManager")
    store = DiskStore(tmp_path / "kc")
    kt.set_cache(Cache([store]))
    try:
        kernel, _ = triton_kernels.compile_kernel("add")
        ttir = tmp_path / "add.ttir"
        ttir.write_text(Path(kernel.metadata_group["add_kernel.ttir"]).read_text())
        triton.compile(str(ttir), target=triton_kernels.TARGET)
        records = [entry.key_record for info in store.scan() if (entry := store.get(info.key))]
    finally:
        kt.set_cache(None)
        store.close()
    labels = [{f[0] for f in r["fields"]} for r in records if r is not None]
    from_ir = [found for found in labels if "signature.n" not in found]
    assert len(labels) == 2, labels
    assert len(from_ir) == 1, labels
    assert {"source", "kernel", "options.num_warps", "triton", "file"} & from_ir[0] == {
        "source", "kernel", "options.num_warps", "triton"
    }  # fmt: skip


# JAX ---------------------------------------------------------------------------------------


def test_jax_last_miss_names_the_xla_flags(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    from test_jax import machine, run

    for fast in ("false", "true"):
        env = machine(tmp_path, "m", None, XLA_FLAGS=f"--xla_cpu_enable_fast_math={fast}")
        assert run(env)["kc"]["puts"] == 1
    difference = _only_difference(tmp_path / "m" / "kc", "jax")
    assert difference["label"] == "xla_flags"
    assert difference["words"] == (
        "JAX: XLA flags: --xla_cpu_enable_fast_math=false → --xla_cpu_enable_fast_math=true"
    )


def test_jaxs_own_key_is_named_only_when_no_noted_part_differs() -> None:
    def record(jax_key: str, flags: list[str]) -> dict[str, Any]:
        key = KeyBuilder("jax/1").add("jax_key", jax_key).add("jax", "0.10.2").hexdigest()
        fields.note_fields(key, {"module": "jit_f", "xla_flags": flags})
        found = fields.summary(key)
        assert found is not None
        return found

    stored = record("jit_f-" + "1" * 64, [])
    flags = words.differences(record("jit_f-" + "2" * 64, ["--xla_x=1"]), stored)
    assert [d["label"] for d in flags] == ["xla_flags"]
    program = words.differences(record("jit_f-" + "3" * 64, []), stored)
    assert [d["label"] for d in program] == ["jax_key"]
    assert program[0]["words"].startswith(
        "JAX's key (the program, its compile options, the devices)"
    )


# torch.compile -----------------------------------------------------------------------------


def test_torch_last_miss_is_filed_and_names_torchs_key(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from test_inductor import MLP, machine, run

    for extra in ({}, MLP):  # another model: another graph, so another key of torch's
        assert run(machine(tmp_path, "m", None, **extra), "infer")["kc"]["puts"] >= 1
    difference = _only_difference(tmp_path / "m" / "kc", "torch")
    assert difference["label"] == "torch_key"
    assert difference["words"].startswith("torch's key (the graph, its inputs")
