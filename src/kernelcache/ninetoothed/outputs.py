"""The files ``ninetoothed.build`` and AOT ``make`` write, as kernelcache entries.

ninetoothed 0.26.0 AOT-compiles a kernel by running ``python -m
triton.tools.compile`` once per specialisation and ``nvcc`` on the C files
they produce, into ``output_dir``. ``build`` reuses an output folder when a
fingerprint file matches; that fingerprint covers ``premake``'s source and
the configs but not the arrangement or application it calls, so editing
them keeps serving the old library. Here the key is the *generated* Triton
source of every config (so any edit that changes the kernel changes the
key), the kernel names, configs, caller, warps and stages, Triton's version
and target, nvcc's and the host compiler's identity, the environment nvcc
reads (:func:`kernelcache.nvcc.key.environment`), ninetoothed's own code,
and the absolute paths compiled into the outputs (``output_dir``, which a
build's CSV fallback names, and the shared header). The files of one call
are ONE entry, compiled once across processes (single-flight) and written
back into ``output_dir`` on a hit, where ninetoothed's own loader takes them.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kernelcache import _fs, fingerprint, toolchain
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.keys import KeyBuilder
from kernelcache.ninetoothed import shapes
from kernelcache.nvcc import key as nvcc_key

NAMESPACE = "kernelcache.ninetoothed.outputs"
SCHEMA = 1
# ninetoothed internals used here, read from 0.24.0 to 0.26.0 (those whose shape moved
# are adapted in kernelcache.ninetoothed.shapes).
HEADER_PATH = "_HEADER_PATH"  # ninetoothed.aot: the shared header every output includes
HEADER_CONTENT = "_HEADER_CONTENT"
GENERATE_SUFFIX = "_generate_suffix"  # ninetoothed.build: config values -> kernel name suffix
_CODE_FILES = ("aot.py", "build.py", "generation.py", "make.py", "jit.py", "tensor.py")


def owned(name: str, kernel_names: Iterable[str]) -> bool:
    """Whether file ``name`` is an output of one of ``kernel_names`` (``<name>.<suffix>``)."""
    return name.split(".", 1)[0] in set(kernel_names)


def collect(output_dir: pathlib.Path, kernel_names: Iterable[str]) -> Entry:
    names = list(kernel_names)
    artifacts = {}
    for item in os.scandir(output_dir):
        if item.is_file(follow_symlinks=False) and owned(item.name, names):
            with open(item.path, "rb") as f:
                artifacts[item.name] = f.read()
    return Entry(artifacts, meta={"ninetoothed_kernels": names})


def restore(entry: Entry, output_dir: pathlib.Path) -> None:
    """Write every file of ``entry`` into ``output_dir``, each atomically."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in entry:
        mode = 0o755 if name.endswith(".so") else 0o644  # what nvcc and ninetoothed leave
        _fs.write_atomic(str(output_dir / name), entry[name], mode=mode)


def _module(name: str) -> Any:
    return importlib.import_module(name)  # ninetoothed's package attributes shadow its modules


def toolchain_fields() -> dict[str, Any]:
    import ninetoothed
    import triton

    aot = _module("ninetoothed.aot")
    package = pathlib.Path(ninetoothed.__file__).parent
    host = shutil.which(os.environ.get("NVCC_CCBIN") or "gcc")
    return {
        "ninetoothed": fingerprint.files([package / name for name in _CODE_FILES], root=package),
        "triton": toolchain.triton(),
        "target": str(triton.runtime.driver.active.get_current_target()),
        "nvcc": toolchain.nvcc(),
        "host": toolchain.executable(host) if host else "probe_failed:FileNotFoundError",
        "header": [str(getattr(aot, HEADER_PATH)), getattr(aot, HEADER_CONTENT)],
        "environment": nvcc_key.environment(os.environ),  # what the nvcc run reads besides argv
    }


_TENSOR_NUMBER = re.compile(r"(?<=tensor_)(\d+)(?![0-9])")


def normalized(source: str) -> str:
    """``source`` with ninetoothed's tensor numbers renumbered by first appearance.

    Tensors are named from a process-wide counter (``tensor_330``), so the same
    kernel generated after a different number of ``Tensor()`` calls differs
    only in those numbers; the key must not.
    """
    numbers: dict[str, str] = {}
    return _TENSOR_NUMBER.sub(lambda m: numbers.setdefault(m.group(1), str(len(numbers))), source)


def generated_source(
    func: Any, caller: str, kernel_name: str, num_warps: int, num_stages: int
) -> str:
    """The Triton source ninetoothed generates for ``func`` (its annotations set by make), normalized."""
    from ninetoothed.generation import CodeGenerator

    path = CodeGenerator()(func, caller, kernel_name, num_warps, num_stages, None, False)
    return normalized(pathlib.Path(path).read_text(encoding="utf-8"))


def application_source(arrangement: Any, application: Any, tensors: Any, **generate: Any) -> str:
    """What ``make`` would generate: its annotation step, then the generator."""
    import inspect

    params = inspect.signature(application).parameters
    types = arrangement(*tensors)
    types = types if isinstance(types, tuple) else (types,)
    application.__annotations__ = dict(zip(params, types, strict=False))
    return generated_source(application, **generate)


def default_configs() -> tuple[int, int]:
    from ninetoothed.utils import calculate_default_configs

    warps, stages = calculate_default_configs()
    return int(warps), int(stages)


def output_key(kind: str, output_dir: pathlib.Path, **fields: Any) -> str:
    builder = KeyBuilder(NAMESPACE).add("schema", SCHEMA).add("kind", kind)
    builder.add("output_dir", str(output_dir.resolve()))
    for label in sorted(fields):
        builder.add(label, fields[label])  # TypeError for a config a key cannot hold
    return builder.add("toolchain", toolchain_fields()).hexdigest()


class OutputCache:
    """The AOT and build hooks; ``original_*`` are ninetoothed's functions."""

    def __init__(
        self,
        original_aot: Callable[..., Any],
        original_build: Callable[..., Any],
        cache: Callable[[], Cache],
        count: Callable[[str], None],
    ) -> None:
        self.original_aot = original_aot
        self.original_build = original_build
        self.cache = cache
        self.count = count

    def _through(
        self,
        key: str,
        names: list[str],
        output_dir: pathlib.Path,
        run: Callable[[], Any],
        load: Callable[[], Any],
    ) -> Any:
        result: list[Any] = []

        def compile_outputs() -> Entry:
            self.count("output_compiles")
            result.append(run())
            return collect(output_dir, names)

        entry = self.cache().get_or_compile(key, compile_outputs)
        if result:
            return result[0]
        self.count("output_hits")
        restore(entry, output_dir)
        return load()

    def aot(
        self,
        func: Any,
        caller: str = "cuda",
        kernel_name: str | None = None,
        output_dir: Any = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> Any:
        warps, stages = default_configs()
        num_warps = warps if num_warps is None else num_warps
        num_stages = stages if num_stages is None else num_stages
        name = kernel_name if kernel_name is not None else func.__name__
        folder = pathlib.Path(output_dir)
        source = generated_source(func, caller, name, num_warps, num_stages)
        key = output_key(
            "aot", folder, sources=[source], kernel_names=[name], caller=caller,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip

        def run() -> Any:
            return self.original_aot(
                func, caller=caller, kernel_name=name, output_dir=folder,
                num_warps=num_warps, num_stages=num_stages,
            )  # fmt: skip

        load = shapes.launch_loader()
        return self._through(key, [name], folder, run, lambda: load(name, folder))

    def build(
        self,
        premake: Any,
        configs: Iterable[Any],
        *,
        meta_parameters: Any = None,
        caller: str | None = None,
        kernel_name: str | None = None,
        output_dir: Any = None,
        lazy: bool = False,
    ) -> Any:
        configs = tuple(configs)
        folder = pathlib.Path(output_dir)
        kwargs: dict[str, Any] = {
            "meta_parameters": None if meta_parameters is None else tuple(meta_parameters),
            "caller": caller or "cuda",
            "kernel_name": kernel_name,
            "output_dir": folder,
        }
        if lazy:
            return _Lazy(lambda: self.build(premake, configs, **kwargs))
        key, names = self._build_key(premake, configs, **kwargs)
        upstream_kwargs = shapes.build_kwargs(self.original_build, **kwargs)

        def run() -> Any:
            # Upstream's fingerprint misses edits to the arrangement or application:
            # without kernelcache's entry, never let it take what the folder holds.
            (folder / f"{kernel_name}.fingerprint").unlink(missing_ok=True)
            return self.original_build(premake, configs, **upstream_kwargs)

        def load() -> Any:
            if shapes.build_reloads():  # upstream finds the restored library itself
                return self.original_build(premake, configs, **upstream_kwargs)
            return shapes.launch_loader()(str(kernel_name), folder)

        return self._through(key, names, folder, run, load)

    def _build_key(
        self, premake: Any, configs: tuple[Any, ...], **kwargs: Any
    ) -> tuple[str, list[str]]:
        import inspect

        build_module = _module("ninetoothed.build")
        suffix = getattr(build_module, GENERATE_SUFFIX)
        warps, stages = default_configs()
        names, sources = [kwargs["kernel_name"]], []
        for args, config_kwargs, compilation in configs:
            # The kernel name build._make gives this config.
            bound = inspect.signature(premake).bind(*args, **config_kwargs)
            bound.apply_defaults()
            combination = {f"{n}_": v for n, v in bound.arguments.items()} | dict(compilation)
            name = f"{kwargs['kernel_name']}_{suffix([shapes.name_value(v) for v in combination.values()])}"
            arrangement, application, tensors = premake(*args, **config_kwargs)
            sources.append(
                application_source(
                    arrangement, application, tensors, caller=kwargs["caller"], kernel_name=name,
                    num_warps=compilation.get("num_warps", warps),
                    num_stages=compilation.get("num_stages", stages),
                )
            )  # fmt: skip
            names.append(name)
        key = output_key(
            "build", kwargs["output_dir"], sources=sources, kernel_names=names,
            configs=[[list(a), dict(k), dict(c)] for a, k, c in configs],
            meta_parameters=None if kwargs["meta_parameters"] is None else list(kwargs["meta_parameters"]),
            caller=kwargs["caller"],
        )  # fmt: skip
        return key, names


class _Lazy:
    """Builds on first call (``build(..., lazy=True)``: no process pool at import time)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._kernel: Any = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._kernel is None:
                self._kernel = self._factory()
        return self._kernel(*args, **kwargs)
