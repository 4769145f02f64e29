"""TileLang's seams whose shape moved between releases: one small adapter per shape.

Each is chosen by probing what the installed TileLang has, never by its
version string (:mod:`kernelcache.versions`):

- **the backend context.** From 0.1.14, TileLang resolves the target, the
  host target and the execution backend into one ``BackendContext``
  (``tilelang.backend.module``) that ``_load_kernel_from_disk``,
  ``JITKernel`` and ``JITKernel.from_database`` take. 0.1.13 passes the
  three apart. :func:`takes_context` reads which from the loader's own
  signature; :class:`Separate` holds 0.1.13's three in the places the hooks
  read a context (``.target``, ``.target_host``, ``.execution_backend.name``),
  and :func:`context_kwargs` gives ``JITKernel`` a context only when it is one.
- **kernel parameters as text.** 0.1.15 writes them as TVM JSON
  (``tilelang.engine.param.dump_kernel_params``); 0.1.13 and 0.1.14 pickle
  them (cloudpickle), which a kernelcache entry never holds (a shared entry
  that unpickles is code execution). Without upstream's functions, the same
  TVM JSON reflection is done here, so an entry reads the same on every
  release.

Entries stay apart per release: TileLang's version is a field of every key
(:func:`kernelcache.tilelang.keys.shared_fields`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The artifact name of an entry's kernel parameters (JSON on every release).
PARAMS = "params.json"
# The names probed, for the table of seams (kernelcache.tilelang.SEAMS).
DUMP_PARAMS = "tilelang.engine.param:dump_kernel_params"  # 0.1.15
LOAD_PARAMS = "tilelang.engine.param:load_kernel_params"
TVM_SAVE_JSON = "tvm.ir:save_json"  # what the fallback uses (TileLang's bundled TVM)
CONTEXT_PARAMETER = "backend_context"


def takes_context(loader: Callable[..., Any]) -> bool:
    """Whether TileLang's ``_load_kernel_from_disk`` takes one ``backend_context`` (0.1.14+)."""
    return CONTEXT_PARAMETER in inspect.signature(loader).parameters


@dataclass(frozen=True)
class Backend:
    name: str


@dataclass(frozen=True)
class Separate:
    """TileLang 0.1.13's target, host target and execution backend, read as a context is."""

    target: Any
    target_host: Any
    execution_backend: Backend

    @classmethod
    def of(cls, target: Any, target_host: Any, execution_backend: str) -> Separate:
        return cls(target, target_host, Backend(str(execution_backend)))


def context_kwargs(context: Any) -> dict[str, Any]:
    """``backend_context=`` for ``JITKernel`` when TileLang gave one (0.1.14+), else nothing."""
    return {} if isinstance(context, Separate) else {CONTEXT_PARAMETER: context}


@functools.cache
def _param_functions() -> tuple[Callable[[Any], str], Callable[[str], Any]]:
    from tilelang.engine import param

    dump, load = (
        getattr(param, "dump_kernel_params", None),
        getattr(param, "load_kernel_params", None),
    )
    if dump is not None and load is not None:
        return dump, load
    return _dump_params, _load_params


def dump_params(params: Any) -> str:
    """A kernel's parameters as TVM JSON text (no pickle on any release)."""
    return _param_functions()[0](params)


def load_params(text: str) -> Any:
    """The parameters :func:`dump_params` wrote, as ``KernelParam`` objects."""
    return _param_functions()[1](text)


# For releases without upstream's functions (0.1.13, 0.1.14): the same records, the same
# reflection (symbolic sizes round-trip, a Var shared by two params stays one Var).
def _dump_params(params: Any) -> str:
    from tilelang import tvm

    records = [{"dtype": str(param.dtype), "shape": list(param.shape)} for param in params]
    text: str = tvm.ir.save_json(tvm.runtime.convert(records))
    return text


def _load_params(text: str) -> Any:
    from tilelang import tvm
    from tilelang.engine.param import KernelParam

    params = []
    for record in tvm.ir.load_json(text):
        dtype = tvm.DataType(str(record["dtype"]))
        shape = [d if isinstance(d, tvm.ir.PrimExpr) else int(d) for d in record["shape"]]
        params.append(KernelParam(dtype, shape))
    return params
