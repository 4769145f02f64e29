"""vLLM's general plugin: every vLLM process compiles its JIT kernels through kernelcache (issue 37).

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes
(the engine and every worker) and calls it with no arguments. With
``KERNELCACHE_VLLM=1`` (nothing happens otherwise), :func:`register` sets, in
this process's environment (inherited by the processes it starts):

- ``FLASHINFER_NVCC_LAUNCHER``: the ``kernelcache`` command, in front of the nvcc
  of FlashInfer's JIT ninja files (FlashInfer 0.6.11 or later);
- ``DG_JIT_NVCC_COMPILER``: the shim of :mod:`kernelcache.servers.shim`, for DeepGEMM;
- ``PYTORCH_NVCC``: ``kernelcache <nvcc>``, for torch's JIT extensions;
- ``TRITON_CACHE_MANAGER``: :class:`kernelcache.triton.CacheManager`;
- ``KERNELCACHE_INDUCTOR=1``, and :func:`kernelcache.inductor.install` when torch
  is already imported: Inductor's FX graph and AOTAutograd caches go through
  kernelcache. vLLM's own compile cache (``VLLM_CACHE_ROOT/torch_compile_cache``)
  stays vLLM's; see docs/llm-servers.md.

A variable the user set already is left alone. One log line (on vLLM's logger,
so in vLLM's format) says what was set; a launcher or nvcc that cannot be found
is said in the same line and that variable is left unset.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

VARIABLE = "KERNELCACHE_VLLM"
#: A child of vLLM's logger: vLLM gives it a handler and its format.
LOGGER = "vllm.plugins.kernelcache"
_done = False


def register() -> None:
    """The entry point vLLM calls (``load_general_plugins``): see the module docstring."""
    global _done
    value = os.environ.get(VARIABLE, "").strip().lower()
    if _done or value in ("", "0", "false", "no", "off"):
        return
    _done = True
    log = logging.getLogger(LOGGER)
    if value not in ("1", "true", "yes", "on"):
        log.warning("kernelcache: %s=%r is neither 0 nor 1: nothing set", VARIABLE, value)
        return
    set_now, missing = configure(os.environ)
    if "torch" in sys.modules and set_now.get("KERNELCACHE_INDUCTOR") == "1":
        import kernelcache.inductor

        kernelcache.inductor.install()
    note = f"; not set: {'; '.join(missing)}" if missing else ""
    log.info("kernelcache: compiling through the cache: %s%s", ", ".join(sorted(set_now)), note)


def configure(env: os._Environ[str] | dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Set the variables ``env`` lacks; returns those set and why others were not."""
    from kernelcache.errors import KernelCacheError
    from kernelcache.servers import shim
    from kernelcache.settings import Settings

    wanted: dict[str, str] = {
        "TRITON_CACHE_MANAGER": "kernelcache.triton:CacheManager",
        "KERNELCACHE_INDUCTOR": "1",
    }
    missing: list[str] = []
    try:
        launcher, nvcc = shim.front(env), shim.real_nvcc(env)
    except FileNotFoundError as exc:
        missing.append(f"FLASHINFER_NVCC_LAUNCHER, DG_JIT_NVCC_COMPILER, PYTORCH_NVCC ({exc})")
    else:
        wanted["FLASHINFER_NVCC_LAUNCHER"] = launcher
        wanted["PYTORCH_NVCC"] = f"{shlex.quote(launcher)} {shlex.quote(nvcc)}"
        if "DG_JIT_NVCC_COMPILER" not in env:
            try:
                settings = Settings.load(environ=dict(env))
                if settings.read_only:  # the shim is a file written in the cache directory
                    raise KernelCacheError("KERNELCACHE_READONLY is set: no shim is written")
                wanted["DG_JIT_NVCC_COMPILER"] = shim.install(settings.dir, nvcc, launcher)
            except (OSError, KernelCacheError) as exc:
                missing.append(f"DG_JIT_NVCC_COMPILER ({exc})")
    set_now = {name: value for name, value in wanted.items() if name not in env}
    env.update(set_now)
    return set_now, missing
