"""ninetoothed's JIT auto-tuner through :mod:`kernelcache.autotune`, keyed by GPU model.

``ninetoothed.auto_tuner.AutoTuner`` (0.26.0) keeps timings in JSON files
under ``~/.ninetoothed/auto_tuning/<package hash>_triton_<version>/``,
written in place with ``write_text`` and keyed without the GPU: timings from
one GPU model pick the config on another. Here ``AutoTuner._get_timings``
asks an :class:`~kernelcache.autotune.AutotuneCache` for the record of
(candidate kernels, argument shapes and dtypes, GPU name and capability,
Triton and ninetoothed versions); on a miss it benchmarks every candidate
once, single-flight across processes, and stores the timings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelcache.autotune import AutotuneCache
from kernelcache.ninetoothed import shapes

# ninetoothed internals read from 0.24.0 to 0.26.0.
FUNCS = "_funcs"  # AutoTuner: the candidate kernels, in order
KEYS = "_keys"  # AutoTuner: one str key per candidate (its config)
ARG_KEY = "_make_arg_key"  # AutoTuner: (args, kwargs) -> "tensor(shape=..., dtype=...), ..."


class TunerHooks:
    """The replacement of ``AutoTuner._get_timings``; ``bench()`` gives what times one
    call (``None``: Triton's ``do_bench``)."""

    def __init__(
        self,
        records: Callable[[], AutotuneCache],
        device: Callable[[], Any],
        bench: Callable[[], Callable[[Callable[[], Any]], float] | None] = lambda: None,
        count: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.records = records
        self.device = device
        self.bench = bench
        self.count = count

    def _bench(self, fn: Callable[[], Any]) -> float:
        bench = self.bench()  # read per call: a later install() may bring another
        if bench is not None:
            return bench(fn)
        import triton

        return float(triton.testing.do_bench(fn))

    def get_timings(self, tuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[float]:
        funcs = getattr(tuner, FUNCS)
        kernel_key = {
            "ninetoothed_candidates": [str(key) for key in getattr(tuner, KEYS)],
            "ninetoothed": _version(),
        }
        problem = str(getattr(type(tuner), ARG_KEY)(args, kwargs))
        launch_error = shapes.launch_errors()

        def tune() -> tuple[Any, Any]:
            self.count("autotune_runs")
            timings: list[float | None] = []
            for func in funcs:
                try:
                    timings.append(self._bench(_call(func, args, kwargs)))
                except launch_error:
                    timings.append(None)  # JSON has no inf: a config that cannot launch
            best = min(range(len(timings)), key=lambda i: _finite(timings[i]))
            return best, timings

        record = self.records().get_or_tune(kernel_key, problem, self.device(), tune)
        return [_finite(t) for t in record["timings"]]


def _call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], Any]:
    return lambda: func(*args, **kwargs)


def _finite(timing: float | None) -> float:
    return float("inf") if timing is None else float(timing)


def _version() -> str:
    from importlib.metadata import version

    return version("ninetoothed")
