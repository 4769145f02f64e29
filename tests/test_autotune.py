"""kernelcache.autotune: records keyed by kernel, problem, device and toolchain."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from kernelcache import Cache, ConfigError, DiskStore, Entry, MemoryStore
from kernelcache.autotune import AutotuneCache, current_device, default_toolchain, device_info

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
KERNEL, PROBLEM = "matmul_v3", {"M": 4096, "N": 4096, "K": 512, "dtype": "fp16"}
BEST = {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": (3,)}
TIMINGS = [[{"BLOCK_M": 64}, 1.25], [{"BLOCK_M": 128}, 0.91]]


@pytest.fixture
def tuner(tmp_path: Path) -> AutotuneCache:
    return AutotuneCache(Cache([DiskStore(tmp_path / "kc")]))


def test_record_then_lookup(tuner: AutotuneCache) -> None:
    stored = tuner.record(KERNEL, PROBLEM, H100, BEST, TIMINGS)
    found = tuner.lookup(KERNEL, PROBLEM, H100)
    assert found == stored
    assert found is not None
    assert found["best_config"] == {**BEST, "num_stages": [3]}  # JSON: tuples come back as lists
    assert found["timings"] == TIMINGS
    assert found["device"] == {"name": H100["name"], "capability": [9, 0]}
    assert found["toolchain"] == default_toolchain()


@pytest.mark.parametrize(
    ("kernel", "problem", "device"),
    [
        pytest.param(KERNEL, PROBLEM, {**H100, "name": "NVIDIA H200"}, id="other-gpu-model"),
        pytest.param(KERNEL, PROBLEM, {**H100, "capability": (9, 1)}, id="other-capability"),
        pytest.param(
            KERNEL, PROBLEM, {"name": "NVIDIA A100-SXM4-80GB", "capability": (8, 0)}, id="ampere"
        ),
        pytest.param(KERNEL, {**PROBLEM, "M": 2048}, H100, id="other-problem"),
        pytest.param(KERNEL, {**PROBLEM, "dtype": "bf16"}, H100, id="other-dtype"),
        pytest.param("matmul_v4", PROBLEM, H100, id="other-kernel"),
    ],
)
def test_record_is_not_returned_for_another_key(
    tuner: AutotuneCache, kernel: Any, problem: Any, device: Any
) -> None:
    tuner.record(KERNEL, PROBLEM, H100, BEST, TIMINGS)
    assert tuner.lookup(kernel, problem, device) is None


@pytest.mark.parametrize(
    "toolchain",
    [
        pytest.param({**default_toolchain(), "triton": "3.8.0"}, id="other-triton"),
        pytest.param({**default_toolchain(), "python": "CPython 3.12.1"}, id="other-python"),
        pytest.param({"nvrtc": "13.0"}, id="explicit"),
    ],
)
def test_record_is_not_returned_for_another_toolchain(tuner: AutotuneCache, toolchain: Any) -> None:
    tuner.record(KERNEL, PROBLEM, H100, BEST, TIMINGS)
    other = AutotuneCache(tuner.cache, toolchain=toolchain)
    assert other.lookup(KERNEL, PROBLEM, H100) is None
    other.record(KERNEL, PROBLEM, H100, {"BLOCK_M": 64}, [])
    assert other.lookup(KERNEL, PROBLEM, H100)["best_config"] == {"BLOCK_M": 64}  # type: ignore[index]
    assert tuner.lookup(KERNEL, PROBLEM, H100)["best_config"]["BLOCK_M"] == 128  # type: ignore[index]


def test_mislabelled_entry_is_a_miss(tuner: AutotuneCache) -> None:
    # A record for another GPU placed under this GPU's key (a bad import, a foreign writer).
    tuner.record(KERNEL, PROBLEM, {**H100, "name": "NVIDIA H200"}, BEST, TIMINGS)
    forged = tuner.cache.get(tuner.key(KERNEL, PROBLEM, {**H100, "name": "NVIDIA H200"}))
    assert forged is not None
    tuner.cache.put(tuner.key(KERNEL, PROBLEM, H100), Entry(dict(forged)))
    assert tuner.lookup(KERNEL, PROBLEM, H100) is None


def test_record_survives_the_process(tuner: AutotuneCache, tmp_path: Path) -> None:
    tuner.record(KERNEL, PROBLEM, H100, BEST, TIMINGS)
    code = (
        "import json, sys\n"
        "from kernelcache import Cache, DiskStore\n"
        "from kernelcache.autotune import AutotuneCache\n"
        f"t = AutotuneCache(Cache([DiskStore({str(tmp_path / 'kc')!r})]))\n"
        f"print(json.dumps(t.lookup({KERNEL!r}, {PROBLEM!r}, {H100!r})['best_config']))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == '{"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": [3], "num_warps": 8}'


@pytest.mark.parametrize(
    ("best", "timings", "error", "match"),
    [
        pytest.param(object(), [], TypeError, "best_config must be JSON", id="object"),
        pytest.param({"a": {1, 2}}, [], TypeError, r"best_config\['a'\]", id="set"),
        pytest.param({1: "x"}, [], TypeError, "non-str key", id="int-key"),
        pytest.param({}, [["c", float("inf")]], ValueError, r"timings\[0\]\[1\]", id="inf"),
        pytest.param({}, {"c": float("nan")}, ValueError, "JSON cannot hold", id="nan"),
    ],
)
def test_only_json_values_are_recorded(
    tuner: AutotuneCache, best: Any, timings: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        tuner.record(KERNEL, PROBLEM, H100, best, timings)
    assert tuner.lookup(KERNEL, PROBLEM, H100) is None


def test_keys_must_be_json(tuner: AutotuneCache) -> None:
    with pytest.raises(TypeError, match="kernel_key must be JSON"):
        tuner.lookup(lambda: None, PROBLEM, H100)


def test_device_from_objects_like_cuda_core_and_torch() -> None:
    Capability = namedtuple("Capability", "major minor")

    class CoreDevice:  # cuda.core.Device's shape
        name = "NVIDIA H100 80GB HBM3"
        compute_capability = Capability(9, 0)

    expected = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    assert device_info(CoreDevice()) == expected
    assert device_info({"name": expected["name"], "capability": [9, 0]}) == expected


@pytest.mark.parametrize(
    "device",
    [
        pytest.param({"name": "", "capability": (9, 0)}, id="empty-name"),
        pytest.param({"name": "H100"}, id="no-capability"),
        pytest.param({"name": "H100", "capability": "9.0"}, id="str-capability"),
        pytest.param({"name": "H100", "capability": (9, 0, 1)}, id="three-parts"),
        pytest.param({"name": "H100", "capability": (True, 0)}, id="bool"),
    ],
)
def test_bad_devices_are_refused(tuner: AutotuneCache, device: Any) -> None:
    with pytest.raises(ConfigError, match="capability"):
        tuner.lookup(KERNEL, PROBLEM, device)


def test_device_detection_without_a_gpu_says_what_to_pass() -> None:
    try:
        found = current_device()
    except ConfigError:  # no GPU here: the error says what to do instead
        with pytest.raises(ConfigError, match="pass the device explicitly"):
            current_device()
    else:  # a machine with a GPU
        assert found["name"]
        assert len(found["capability"]) == 2


def test_get_or_tune_tunes_once() -> None:
    tuner = AutotuneCache(Cache([MemoryStore()]))
    calls = []

    def tune() -> tuple[Any, Any]:
        calls.append(1)
        return {"BLOCK": 64}, {"64": 1.0, "128": 1.5}

    first = tuner.get_or_tune(KERNEL, PROBLEM, H100, tune)
    second = tuner.get_or_tune(KERNEL, PROBLEM, H100, tune)
    assert first == second
    assert first["best_config"] == {"BLOCK": 64}
    assert calls == [1]
