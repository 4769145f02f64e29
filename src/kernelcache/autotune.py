"""Autotuning results that survive the process: best config per kernel, problem, GPU and toolchain.

>>> tuner = AutotuneCache()
>>> dev = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
>>> tuner.record("matmul_v3", {"M": 4096, "N": 4096, "dtype": "fp16"}, dev,
...              best_config={"BLOCK_M": 128, "num_warps": 8}, timings={"a": 1.2, "b": 0.9})
>>> tuner.lookup("matmul_v3", {"M": 4096, "N": 4096, "dtype": "fp16"}, dev)["best_config"]

The key holds the device's name and compute capability and a toolchain
fingerprint, so a timing measured on one GPU model or compiler version is
never served to another. Records are JSON (never pickle): tuples come back as
lists. The default toolchain fingerprint is the Python implementation and
version plus ``kernelcache.toolchain.triton()``; pass ``toolchain=`` (any
JSON value, e.g. ``kernelcache.toolchain.nvrtc()``) when other compilers
decide the timings.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.errors import ConfigError, CorruptEntry
from kernelcache.keys import KeyBuilder

__all__ = ["AutotuneCache", "current_device", "default_toolchain", "device_info"]

NAMESPACE = "kernelcache.autotune"
RECORD_NAME = "record.json"
RECORD_VERSION = 1


def device_info(device: Any) -> dict[str, Any]:
    """``{"name": str, "capability": [major, minor]}`` from a dict or an object.

    Accepts ``name`` plus ``capability`` or ``compute_capability`` (a pair,
    or an object with ``major``/``minor`` as cuda.core's ``Device`` gives).
    """
    if device is None:
        return current_device()
    get = device.get if isinstance(device, Mapping) else functools.partial(getattr, device)
    name = get("name", None)
    capability = get("capability", None)
    if capability is None:
        capability = get("compute_capability", None)
    if hasattr(capability, "major") and hasattr(capability, "minor"):
        capability = (capability.major, capability.minor)
    if callable(name):  # torch-style accessors
        name = name()
    if (
        not isinstance(name, str)
        or not name
        or not isinstance(capability, (tuple, list))
        or len(capability) != 2
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
    ):
        raise ConfigError(
            f"device must give a non-empty str name and a (major, minor) int capability, "
            f"e.g. {{'name': 'NVIDIA H100 80GB HBM3', 'capability': (9, 0)}}; got {device!r}"
        )
    return {"name": name, "capability": [int(capability[0]), int(capability[1])]}


def current_device(index: int = 0) -> dict[str, Any]:
    """The name and capability of CUDA device ``index``, through torch or cuda.core.

    Raises :class:`~kernelcache.errors.ConfigError` when neither can see a GPU:
    pass the device explicitly then.
    """
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        reason = "torch is not installed"
    else:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(index)
            return {"name": torch.cuda.get_device_name(index), "capability": [major, minor]}
        reason = "torch sees no CUDA device"
    try:
        from cuda.core import Device

        dev = Device(index)
        return device_info({"name": dev.name, "capability": dev.compute_capability})
    except ImportError as exc:
        reason = f"{reason}; cuda.core is not installed ({exc})"
    except (RuntimeError, OSError, ValueError) as exc:  # CUDAError is a RuntimeError
        reason = f"{reason}; cuda.core: {type(exc).__name__}: {exc}"
    raise ConfigError(
        f"cannot detect CUDA device {index} ({reason}); pass the device explicitly, "
        "e.g. {'name': 'NVIDIA H100 80GB HBM3', 'capability': (9, 0)}"
    )


@functools.cache
def default_toolchain() -> dict[str, str]:
    """A minimal toolchain fingerprint: Python implementation and version, Triton version."""
    from kernelcache import toolchain

    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "triton": toolchain.triton(),  # "probe_failed:..." when absent or broken
    }


def _check_json(value: Any, where: str) -> None:
    """Raise unless ``value`` is plain JSON (finite numbers, str-keyed objects)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{where} is {value!r}, which JSON cannot hold; leave failed configs out "
                "or record None for them"
            )
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-str key {k!r}; JSON objects need str keys")
            _check_json(item, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} must be JSON (None, bool, int, float, str, list, dict), "
        f"not {type(value).__module__}.{type(value).__qualname__}"
    )


def _normal(value: Any) -> Any:
    """The value as it comes back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


class AutotuneCache:
    """Best configs by ``(kernel_key, problem_key, device, toolchain)`` over a kernelcache Cache.

    Thread- and process-safe as its cache is: a record is one entry, replaced
    atomically; the last writer of a key wins.
    """

    def __init__(self, cache: Cache | None = None, *, toolchain: Any = None) -> None:
        self.cache = cache if cache is not None else Cache()
        self.toolchain = _normal(default_toolchain() if toolchain is None else toolchain)
        _check_json(self.toolchain, "toolchain")

    def key(self, kernel_key: Any, problem_key: Any, device: Any) -> str:
        """The cache key of one record (what :meth:`lookup` and :meth:`record` use)."""
        _check_json(kernel_key, "kernel_key")
        _check_json(problem_key, "problem_key")
        dev = device_info(device)
        return (
            KeyBuilder(NAMESPACE)
            .add("record_version", RECORD_VERSION)
            .add("kernel", kernel_key)
            .add("problem", problem_key)
            .add("device_name", dev["name"])
            .add("capability", dev["capability"])
            .add("toolchain", self.toolchain)
            .hexdigest()
        )

    def lookup(self, kernel_key: Any, problem_key: Any, device: Any) -> dict[str, Any] | None:
        """The record for this kernel, problem and device (``None``: detect it), or ``None``."""
        dev = device_info(device)
        entry = self.cache.get(self.key(kernel_key, problem_key, dev))
        if entry is None:
            return None
        return self._verified(entry, kernel_key, problem_key, dev)

    def record(
        self,
        kernel_key: Any,
        problem_key: Any,
        device: Any,
        best_config: Any,
        timings: Any,
    ) -> dict[str, Any]:
        """Store the outcome of one tuning run; returns the record as lookups will see it."""
        dev = device_info(device)
        key = self.key(kernel_key, problem_key, dev)
        entry = self._entry(kernel_key, problem_key, dev, best_config, timings)
        self.cache.put(key, entry)
        return dict(json.loads(entry[RECORD_NAME]))

    def get_or_tune(
        self,
        kernel_key: Any,
        problem_key: Any,
        device: Any,
        tune: Callable[[], tuple[Any, Any]],
    ) -> dict[str, Any]:
        """The stored record, or run ``tune() -> (best_config, timings)`` and store its result."""
        dev = device_info(device)

        def run() -> Entry:
            best_config, timings = tune()
            return self._entry(kernel_key, problem_key, dev, best_config, timings)

        entry = self.cache.get_or_compile(self.key(kernel_key, problem_key, dev), run)
        found = self._verified(entry, kernel_key, problem_key, dev)
        if found is None:
            raise CorruptEntry("the stored autotune record does not match its key")
        return found

    def _entry(
        self, kernel_key: Any, problem_key: Any, dev: dict[str, Any], best_config: Any, timings: Any
    ) -> Entry:
        _check_json(best_config, "best_config")
        _check_json(timings, "timings")
        record = {
            "version": RECORD_VERSION,
            "kernel_key": kernel_key,
            "problem_key": problem_key,
            "device": dev,
            "toolchain": self.toolchain,
            "best_config": best_config,
            "timings": timings,
            "recorded_at": time.time(),
        }
        raw = json.dumps(record, sort_keys=True, allow_nan=False).encode()
        return Entry({RECORD_NAME: raw}, meta={"autotune": RECORD_VERSION})

    def _verified(
        self, entry: Entry, kernel_key: Any, problem_key: Any, dev: dict[str, Any]
    ) -> dict[str, Any] | None:
        # The key already separates devices and toolchains; checking the record
        # too means a foreign or mislabelled entry is a miss, never a wrong config.
        try:
            record = json.loads(entry[RECORD_NAME])
        except (KeyError, ValueError):
            return None
        expected = {
            "version": RECORD_VERSION,
            "kernel_key": _normal(kernel_key),
            "problem_key": _normal(problem_key),
            "device": dev,
            "toolchain": self.toolchain,
        }
        if not isinstance(record, dict) or any(record.get(k) != v for k, v in expected.items()):
            return None
        return record
