"""ninetoothed's seams whose shape moved between releases: one small adapter per shape.

Each is chosen by probing what the installed ninetoothed has, never by its
version string (:mod:`kernelcache.versions`):

- **build's keywords.** 0.25 added ``meta_parameters`` and ``lazy`` to
  ``ninetoothed.build``; 0.24 takes ``caller``, ``kernel_name`` and
  ``output_dir`` only. :func:`build_kwargs` passes what the installed
  ``build`` takes (and refuses, as ninetoothed would, a value it cannot take).
- **a config's kernel name.** ``build`` names each config's kernel
  ``<name>_<values>``; 0.25 turns each value into an int
  (``build._arg_to_int``), 0.24 spells booleans and dtypes as macros
  (``aot._MACRO_MAPPING``, ``aot._DTYPE_MAPPING``). :func:`name_value` is
  the installed one's rule.
- **loading outputs without compiling.** 0.25 split ``aot._load_launch_func``
  (``dlopen`` and the argument wrapper) from the nvcc run; 0.24 has only the
  two together (``_generate_launch_func``), so a hit would run nvcc again.
  :func:`launch_loader` gives upstream's loader, else the same ``dlopen``
  (``aot._load_library``) and the same wrapper as 0.24's.
- **a candidate that cannot launch.** 0.25's auto-tuner times it as infinite
  (``aot._KernelLaunchError``); 0.24's lets the error out (:func:`launch_errors`).
- **build's own reuse.** From 0.25, ``build`` returns the library already in
  ``output_dir`` (``build._load_cached``), auto-tuned kernels included; 0.24
  always compiles. :func:`build_reloads` says whether a hit may call ``build``
  again to load what kernelcache restored, or must load the dispatcher itself.

Entries stay apart per release: ninetoothed's own code is a field of every
output key (:func:`kernelcache.ninetoothed.outputs.toolchain_fields`).
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import itertools
import pathlib
from collections.abc import Callable
from typing import Any

# The names probed, for the table of seams (kernelcache.ninetoothed.SEAMS).
LOAD_LAUNCH_FUNC = ("ninetoothed.aot", "_load_launch_func")  # 0.25+
LOAD_LIBRARY = ("ninetoothed.aot", "_load_library")  # 0.24's dlopen, under the fallback
ARG_TO_INT = ("ninetoothed.build", "_arg_to_int")  # 0.25+
MACROS = ("ninetoothed.aot", "_MACRO_MAPPING")  # 0.24's spelling of a boolean
DTYPES = ("ninetoothed.aot", "_DTYPE_MAPPING")
LOAD_CACHED = ("ninetoothed.build", "_load_cached")  # 0.25+
LAUNCH_ERROR = ("ninetoothed.aot", "_KernelLaunchError")  # 0.25+


def _module(name: str) -> Any:
    return importlib.import_module(name)  # ninetoothed's package attributes shadow its modules


def _found(seam: tuple[str, str]) -> Any:
    return getattr(_module(seam[0]), seam[1], None)


def build_kwargs(build: Callable[..., Any], **given: Any) -> dict[str, Any]:
    """The keywords ``build`` takes, from ``given``; a value it cannot take is a TypeError.

    A keyword left at ``None`` or ``False`` (the default of every keyword
    0.25 added) is dropped for a ``build`` that lacks it.
    """
    params = inspect.signature(build).parameters
    kept = {}
    for name, value in given.items():
        if name in params:
            kept[name] = value
        elif value not in (None, False):
            raise TypeError(f"this ninetoothed's build() takes no {name!r} argument")
    return kept


def name_value(value: Any) -> Any:
    """A config value as the installed ``build`` writes it into the config's kernel name."""
    to_int = _found(ARG_TO_INT)
    if to_int is not None:
        return to_int(value)
    # ninetoothed 0.24's build._make: booleans as macros, dtypes as their C names.
    macros, dtypes = _found(MACROS), _found(DTYPES)
    if isinstance(value, bool):
        return macros[value][0]
    if value in dtypes:
        return dtypes[value]
    return value


def launch_errors() -> type[BaseException] | tuple[()]:
    """What the auto-tuner counts as a candidate that cannot launch (timed as infinite).

    0.25 raises ``aot._KernelLaunchError`` for it; 0.24's tuner lets every error
    out, so nothing is caught (``except ()`` catches nothing)."""
    error = _found(LAUNCH_ERROR)
    return error if error is not None else ()


def build_reloads() -> bool:
    """Whether ``build`` returns the outputs already in ``output_dir`` without compiling."""
    return _found(LOAD_CACHED) is not None


def launch_loader() -> Callable[[str, pathlib.Path], Any]:
    """``(kernel_name, output_dir) -> launcher`` for a library in place, with no nvcc run."""
    loader = _found(LOAD_LAUNCH_FUNC)
    return loader if loader is not None else _load_launch


def _load_launch(kernel_name: str, output_dir: pathlib.Path) -> Any:
    """ninetoothed 0.24's ``_generate_launch_func`` without its nvcc run: the same
    ``dlopen`` and the same argument wrapper."""
    import torch

    aot = _module("ninetoothed.aot")
    library = aot._load_library(kernel_name, pathlib.Path(output_dir))  # noqa: SLF001
    launch = getattr(library, f"launch_{kernel_name}")
    dtypes = tuple(aot._DTYPE_MAPPING)  # noqa: SLF001

    def run(*args: Any, **kwargs: Any) -> None:
        arguments = []
        for arg in itertools.chain(args, kwargs.values()):
            if isinstance(arg, torch.Tensor):
                arg = aot._ArgumentTensor.from_torch_tensor(arg)  # noqa: SLF001
            elif isinstance(arg, str) and arg in dtypes:
                arg = dtypes.index(arg)
            arguments.append(arg)
        result = launch(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), *arguments)
        if result != 0:
            raise RuntimeError(f"Kernel launch failed with error code: {result}.")

    return run
