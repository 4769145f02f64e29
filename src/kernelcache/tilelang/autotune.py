"""TileLang's autotuning results through :mod:`kernelcache.autotune`.

TileLang 0.1.15 persists an ``AutotuneResult`` as a folder holding the
best config, the latencies, a *cloudpickle* of the PrimFunc and the kernel's
files, keyed without the GPU model: a result tuned on one GPU is served on
another, and loading it unpickles whatever the cache directory holds. Here
``AutoTuner._save_result_to_disk`` / ``_load_result_from_disk`` record only
JSON (best config, latency, reference latency) in an
:class:`~kernelcache.autotune.AutotuneCache` keyed by TileLang's tuning key,
the GPU's name and compute capability, and the toolchain. A hit recompiles
the best config, which the kernel cache (also kernelcache) answers without
nvcc.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from kernelcache.autotune import AutotuneCache
from kernelcache.errors import ConfigError

logger = logging.getLogger(__name__)

#: TileLang's name for a config's pass configs among compile kwargs (tuner.py, 0.1.15).
PASS_CONFIGS_KWARG = "__pass_configs__"
#: The default compile of a config, used when the tuner has no ``jit_compile`` yet.
DEFAULT_COMPILE = "_default_compile"


class TunerHooks:
    """Replacements for ``AutoTuner._load_result_from_disk`` and ``_save_result_to_disk``."""

    def __init__(self, records: Callable[[], AutotuneCache], device: Callable[[], Any]) -> None:
        self.records = records
        self.device = device

    @staticmethod
    def _kernel_key(tuner: Any, key: str) -> dict[str, Any]:
        import tilelang

        args = tuner.compile_args
        return {
            "tilelang_autotune": key,
            "tilelang": tilelang.__version__,
            "backend": str(args.execution_backend),
            "target": str(args.target),
        }

    def _device(self) -> Any | None:
        try:
            return self.device()
        except ConfigError as exc:  # no GPU visible: nothing was tuned, nothing to serve
            logger.info("kernelcache: TileLang autotune records off: %s", exc)
            return None

    def save(self, tuner: Any, key: str, result: Any) -> None:
        device = self._device()
        if device is None:
            return
        try:
            self.records().record(
                self._kernel_key(tuner, key),
                None,
                device,
                best_config=result.config,
                timings={"latency": result.latency, "ref_latency": result.ref_latency},
            )
        except (TypeError, ValueError) as exc:  # a config JSON cannot hold
            logger.warning("kernelcache: TileLang autotune result not stored: %s", exc)

    def load(self, tuner: Any, key: str) -> Any:
        from tilelang.autotuner.param import AutotuneResult

        device = self._device()
        if device is None:
            return None
        record = self.records().lookup(self._kernel_key(tuner, key), None, device)
        if record is None:
            return None
        config = record["best_config"]
        timings = record["timings"]
        # The compile kwargs TileLang builds from a config (AutoTuner.run, 0.1.15).
        kwargs = {
            name: config[name] for name in inspect.signature(tuner.fn).parameters if name in config
        }
        kwargs[PASS_CONFIGS_KWARG] = config.get("pass_configs")
        compile_config = tuner.jit_compile or getattr(tuner, DEFAULT_COMPILE)
        kernel = compile_config(**kwargs).update_tuner_result(
            latency=timings["latency"], config=config, ref_latency=timings["ref_latency"]
        )
        return AutotuneResult(
            latency=timings["latency"],
            config=config,
            ref_latency=timings["ref_latency"],
            libcode=kernel.get_kernel_source(),
            func=kernel.prim_func,
            kernel=kernel,
        )
