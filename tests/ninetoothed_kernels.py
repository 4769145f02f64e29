"""ninetoothed kernels made by the ninetoothed tests and benchmarks, in a process of their own.

``python ninetoothed_kernels.py MODE ARGS... [--upstream] [--wait-for PATH]`` prints one
JSON line. Modes: ``race N TAG`` makes N kernels named ``k_TAG_<i>`` (each a new
generated source, written and imported) and counts the failures; ``aot DIR`` and
``build DIR`` AOT-compile the add kernel into DIR (build: two block-size configs).
``--upstream`` leaves ninetoothed's own caches in place. The stand-in Triton driver
(``triton_standin.py``) is active: no GPU is needed, and every compile is real.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from typing import Any

import children
import triton_standin

# At import, not in main(): ninetoothed.build's spawned workers import this module.
triton_standin.activate()
triton_standin.cpu_torch_stream()

import ninetoothed  # noqa: E402
from ninetoothed import Tensor  # noqa: E402

BLOCK = 1024


def arrangement(x: Any, y: Any, z: Any, block: int = BLOCK) -> Any:
    return x.tile((block,)), y.tile((block,)), z.tile((block,))


# No annotations: ninetoothed generates the kernel from this function's source.
def application(x, y, z):  # type: ignore[no-untyped-def]
    z = x + y  # noqa: F841 - ninetoothed reads the assignment's AST


def application_minus(x, y, z):  # type: ignore[no-untyped-def]
    z = x - y  # noqa: F841


def arrangement_with_flag(x: Any, y: Any, z: Any, ceil_mode: bool) -> Any:
    """#161's max-pool pattern: a non-tensor (ceil_mode) as an element of ``tensors``."""
    block = 512 if ceil_mode else BLOCK
    return x.tile((block,)), y.tile((block,)), z.tile((block,))


def arrangement_closing_over(block: int) -> Any:
    def arrange(x: Any, y: Any, z: Any) -> Any:
        return x.tile((block,)), y.tile((block,)), z.tile((block,))

    return arrange


def tensors(dtype: Any = None) -> tuple[Any, ...]:
    return tuple(Tensor(1, dtype=dtype) for _ in range(3))


def premake(block: int = BLOCK) -> tuple[Any, Any, Any]:
    return functools.partial(arrangement, block=block), application, tensors(ninetoothed.float32)


def race(count: int, tag: str, start: float | None, slot: float) -> dict[str, Any]:
    """Make ``count`` new kernels; with ``start``, kernel i begins at ``start + i * slot``.

    Processes given the same start and slot generate and import the same
    source at the same moment, the race ninetoothed #161 reports.
    """
    failures = 0
    errors: list[str] = []
    for i in range(count):
        if start is not None:
            time.sleep(max(0.0, start + i * slot - time.time()))
        try:
            handle = ninetoothed.make(
                arrangement, application, tensors(), kernel_name=f"k_{tag}_{i}"
            )
            if not callable(handle):
                raise TypeError(f"make returned {handle!r}")
        except (AttributeError, SyntaxError, ImportError, KeyError, TypeError, OSError) as exc:
            failures += 1
            if len(errors) < 3:
                errors.append("".join(traceback.format_exception_only(exc)).strip())
    return {"failures": failures, "errors": errors, "count": count}


def aot(folder: str) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    kernel = ninetoothed.make(
        arrangement, application, tensors(ninetoothed.float32), caller="cuda",
        kernel_name="add", output_dir=folder, num_warps=4, num_stages=1,
    )  # fmt: skip
    return {"callable": callable(kernel)}


def build(folder: str) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    configs = [((), {"block": block}, {"num_warps": 4, "num_stages": 1}) for block in (512, 1024)]
    kernel = ninetoothed.build(premake, configs, kernel_name="add", output_dir=folder)
    return {"callable": callable(kernel)}


def main(argv: list[str]) -> None:
    if "--upstream" not in argv:
        import kernelcache.ninetoothed

        kernelcache.ninetoothed.install(device={"name": "stand-in sm_90", "capability": (9, 0)})
    if "--wait-for" in argv:
        children.wait_for(argv[argv.index("--wait-for") + 1])
    mode, args = argv[0], [a for a in argv[1:] if not a.startswith("--")]
    start, cpu = time.perf_counter(), children.cpu_seconds()
    if mode == "race":
        go = argv[argv.index("--wait-for") + 1] if "--wait-for" in argv else None
        begin = os.stat(go).st_mtime + 0.2 if go else None
        report = race(int(args[0]), args[1], begin, slot=0.03)
    elif mode == "aot":
        report = aot(args[0])
    else:
        report = build(args[0])
    report["seconds"] = time.perf_counter() - start
    report["cpu_s"] = children.cpu_seconds() - cpu
    if "--upstream" not in argv:
        import kernelcache.ninetoothed

        report["stats"] = kernelcache.ninetoothed.stats()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
