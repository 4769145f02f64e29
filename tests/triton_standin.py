"""A Triton driver that reports an sm_90 GPU on a machine without one (GPU-free tests only).

ninetoothed's code generator asks the active Triton driver for the current
device's properties before it writes a line, and ``triton.tools.compile``
(its AOT path) asks it for the target. Without a GPU no driver is active.
This stand-in answers those questions as an H100 would (target cuda:90:32,
its shared memory and register file); it launches nothing and benchmarks
nothing, and every compile it leads to is real. ``activate()`` makes it the
active driver in this process; ``standin_site/sitecustomize.py`` does the
same in subprocesses (``python -m triton.tools.compile``) whose PYTHONPATH
holds that folder.
"""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

# What an H100 SXM reports (cudaDeviceProp): what ninetoothed reads to size blocks.
PROPERTIES = {
    "max_shared_mem": 232448,
    "max_num_regs": 65536,
    "multiprocessor_count": 132,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 5120,
}


class _Utils:
    def get_device_properties(self, device: int) -> dict[str, int]:
        return dict(PROPERTIES)


class StandInDriver(DriverBase):  # type: ignore[misc]
    def __init__(self) -> None:
        self.utils = _Utils()

    @staticmethod
    def is_active() -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return str(ty_to_cpp(ty))

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        return None

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise RuntimeError("the stand-in Triton driver has no GPU to benchmark on")


def activate() -> None:
    import triton

    triton.runtime.driver.set_active(StandInDriver())


# torch's name for the current CUDA stream getter, absent from CPU builds of torch.
_RAW_STREAM = "_cuda_getCurrentRawStream"


def cpu_torch_stream() -> None:
    """Give a CPU build of torch the stream getter ninetoothed's AOT loader reads (stream 0).

    ``ninetoothed.aot._load_launch_func`` looks the getter up when it loads a
    library, before any launch; on a machine without a GPU it is all that
    stands between a compiled library and a loaded one.
    """
    import importlib

    bindings = importlib.import_module("torch._C")  # torch's C bindings module
    if not hasattr(bindings, _RAW_STREAM):  # a CPU build: no CUDA binding
        setattr(bindings, _RAW_STREAM, lambda device: 0)
