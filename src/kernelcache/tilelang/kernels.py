"""One TileLang backend's kernel cache, backed by kernelcache.

TileLang's ``KernelCache.cached`` (0.1.15) looks in memory, then calls
``_load_kernel_from_disk``; on ``None`` it compiles and calls
``_save_kernel_to_disk``. :class:`BackendHooks` replaces both on one
backend's singleton. The load hook does the whole miss itself, under a
single-flight :meth:`kernelcache.Cache.claim`, so of N threads, processes or
machines missing one kernel at once, one runs nvcc and the others load its
entry; upstream's compile-then-save path is never reached for the targets
handled here (others are passed to TileLang untouched). The compiling caller
gets its kernel back before the entry is packed and published (TileLang's
writers link the library again: ~0.2 s), which a non-daemon thread does. In a
first run, while the key's fields are still being derived, the tvm_ffi compile
starts first and its key is decided before the device code generation
(:mod:`kernelcache.tilelang.firstrun`).

An entry is the file set upstream's per-backend writers produce (device and
host source, the library or cubin, ``params.json``; the nvrtc backend's
``kernel.py`` too), written into a private staging folder and packed as ONE
entry. A hit rebuilds the kernel with ``JITKernel.from_database`` from files
of that entry, as TileLang's own disk hit does, without any compiler call.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernelcache.cache import Cache
from kernelcache.entry import Entry, private_dir
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.integration import Counters
from kernelcache.singleflight import Claim
from kernelcache.tilelang import keys, manifest, recording, shapes
from kernelcache.tilelang.firstrun import FirstRun
from kernelcache.tilelang.keys import kernel_key, pre_key, shared_fields

logger = logging.getLogger(__name__)

#: Target kinds whose compilers the key names; others keep TileLang's own cache.
TARGET_KINDS = ("cuda",)
#: Backends whose file sets are stored here. cutedsl writes its cubin into the cache
#: folder after the first launch (``_set_adapter_cache_path``), which an immutable
#: entry cannot take; torch has no cache upstream.
BACKENDS = ("tvm_ffi", "cython", "nvrtc")

# TileLang's private writers, one per artifact kind; they take any folder.
_WRITERS = (
    "_save_kernel_source_code_to_disk",
    "_save_wrapper_kernel_code_to_disk",
    "_save_so_cubin_to_disk",
)
# Errors from loading a stored library: the entry is unusable, a miss, never a crash.
_LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError, CorruptEntry, StoreError)
# Errors from storing a compiled kernel (TileLang's writers: TVM raises RuntimeError; the
# store): counted and logged, the kernel stays usable.
_STORE_ERRORS = _LOAD_ERRORS


#: What ``kernelcache.tilelang.stats()`` counts.
COUNTERS = (
    "hits",
    "misses",
    "compiles",
    "unusable_entries",
    "passed_through",
    "manifest_hits",
    "bad_manifests",
    "binary_hits",  # nvcc's output found by device code (kernelcache.tilelang.binaries)
    "unpublished",  # compiled here, but its entry could not be stored (logged)
)


def handles(backend: str, target: Any) -> bool:
    """Whether kernels of this backend and target go through kernelcache."""
    kind = getattr(getattr(target, "kind", None), "name", None)
    return backend in BACKENDS and kind in TARGET_KINDS


def pack(
    upstream_cache: Any, kernel: Any, verbose: bool = False, extra: dict[str, Any] | None = None
) -> Entry:
    """The file set TileLang would publish for ``kernel``, as one entry."""
    staging = tempfile.mkdtemp(prefix="kernelcache-tilelang-")
    try:
        for writer in _WRITERS:
            getattr(upstream_cache, writer)(kernel, staging, verbose)
        with open(os.path.join(staging, shapes.PARAMS), "w") as f:
            f.write(shapes.dump_params(kernel.params))
        artifacts = {}
        for item in os.scandir(staging):
            with open(item.path, "rb") as f:
                artifacts[item.name] = f.read()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    meta = {
        "tilelang_backend": kernel.execution_backend,
        "device_source": upstream_cache.device_kernel_path,
        "host_source": upstream_cache.host_kernel_path,
        "library": upstream_cache.kernel_lib_path,
        "params": shapes.PARAMS,
        **(extra or {}),
    }
    return Entry(artifacts, meta=meta)


def folder_of(entry: Entry) -> str:
    """A folder holding every artifact of ``entry`` as a file (loaders find siblings by name).

    A disk tier extracts an entry into one folder; an entry from elsewhere
    (a remote tier, another thread's compile) is copied into a private one.
    """
    paths = {name: entry.path(name) for name in entry}
    folders = {os.path.dirname(path) for path in paths.values()}
    if len(folders) == 1:
        return folders.pop()
    folder = tempfile.mkdtemp(prefix="entry-", dir=private_dir())
    for name, path in paths.items():
        shutil.copyfile(path, os.path.join(folder, name))
    return folder


def load(entry: Entry, call: dict[str, Any]) -> Any:
    """Rebuild a ``JITKernel`` from a stored entry, as TileLang's own disk hit does."""
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource

    meta = entry.meta
    folder = folder_of(entry)
    params = shapes.load_params(entry[meta["params"]].decode())
    device_source = entry.get(meta["device_source"])
    host_source = entry.get(meta["host_source"])
    context = call["backend_context"]
    return JITKernel.from_database(
        func=call["func"],
        # Texts in hand, not paths: an evicted folder must not break get_kernel_source().
        host_kernel_source=CachedTextSource(text=host_source.decode() if host_source else None),
        device_kernel_source=CachedTextSource(
            text=device_source.decode() if device_source else None
        ),
        kernel_lib_path=os.path.join(folder, meta["library"]),
        params=params,
        target=context.target,
        target_host=context.target_host,
        out_idx=call["out_idx"],
        execution_backend=context.execution_backend.name,
        pass_configs=call["pass_configs"],
        compile_flags=call["compile_flags"],
        **shapes.context_kwargs(context),
    )


def _call(
    context: Any, out_idx: Any, pass_configs: Any, compile_flags: Any, func: Any, verbose: bool
) -> dict[str, Any]:
    """What a compile or a hit of one kernel needs, whatever the loader's shape."""
    return {
        "func": func,
        "backend_context": context,
        "out_idx": out_idx,
        "pass_configs": pass_configs,
        "compile_flags": compile_flags,
        "verbose": verbose,
    }


@dataclass(frozen=True)
class Published:
    """What a compile's entry is published and its manifest recorded under, after the
    kernel was handed back (:meth:`BackendHooks._hand_back`)."""

    pre: str | None  # the manifest's key
    key: str
    started: int | None  # the key walk's start (recording.walk_start)
    meta: dict[str, Any]  # the nvcc call noted while compiling (recording.meta)


class BackendHooks:
    """Replacements for one backend singleton's ``_load_kernel_from_disk`` and ``_save_kernel_to_disk``."""

    def __init__(
        self,
        upstream_cache: Any,
        original_load: Callable[..., Any],
        original_save: Callable[..., Any],
        cache: Callable[[], Cache],
        counters: Counters,
    ) -> None:
        self.upstream = upstream_cache
        self.original_load = original_load
        self.original_save = original_save
        self.cache = cache
        self.counters = counters

    def load(
        self,
        key: str,
        backend_context: Any,
        out_idx: Any = None,
        pass_configs: dict[str, Any] | None = None,
        compile_flags: Any = None,
        func: Any = None,
        verbose: bool = False,
    ) -> Any:
        """``_load_kernel_from_disk`` of TileLang 0.1.14+: one ``backend_context``."""
        args = (key, backend_context, out_idx, pass_configs, compile_flags, func, verbose)
        return self._load(
            key, _call(backend_context, out_idx, pass_configs, compile_flags, func, verbose), args
        )

    def load_separate(
        self,
        key: str,
        target: Any = "auto",
        target_host: Any = None,
        out_idx: Any = None,
        execution_backend: str = "tvm_ffi",
        pass_configs: dict[str, Any] | None = None,
        compile_flags: Any = None,
        func: Any = None,
        verbose: bool = False,
    ) -> Any:
        """``_load_kernel_from_disk`` of TileLang 0.1.13: target, host and backend apart."""
        context = shapes.Separate.of(target, target_host, execution_backend)
        args = (
            key, target, target_host, out_idx, execution_backend, pass_configs, compile_flags,
            func, verbose,
        )  # fmt: skip
        return self._load(
            key, _call(context, out_idx, pass_configs, compile_flags, func, verbose), args
        )

    def _load(self, key: str, call: dict[str, Any], args: tuple[Any, ...]) -> Any:
        """The load hook of either shape; ``args`` are upstream's own, for a pass-through."""
        context = call["backend_context"]
        backend = context.execution_backend.name
        if not handles(backend, context.target):
            self.counters.count("passed_through")
            return self.original_load(*args)
        cache = self.cache()
        if backend in manifest.BACKENDS and not keys.settled():
            kc_key, found = self._first_run(cache, key, backend, call)
            if not isinstance(found, Entry):
                return found  # compiled here
            entry = found
        else:
            kc_key, found, compiled = self._lookup(cache, key, backend, call)
            if found is None:
                return compiled
            entry = found
        try:
            kernel = load(entry, call)
        except _LOAD_ERRORS as exc:
            # A damaged or foreign entry (or files removed under us): recompile, replace it.
            logger.warning("kernelcache: unusable TileLang entry %s (%s); recompiling", kc_key, exc)
            self.counters.count("unusable_entries")
            cache.delete(kc_key)
            kernel = self._compile(call)
            cache.put(kc_key, pack(self.upstream, kernel, call["verbose"]))
            return kernel
        self.counters.count("hits")
        return kernel

    def _lookup(
        self, cache: Cache, key: str, backend: str, call: dict[str, Any]
    ) -> tuple[str, Entry | None, Any]:
        """``(key, entry, kernel compiled here or None)``: the key first, then a get or
        a single-flight compile (its entry published after the kernel is handed back)."""
        pre, kc_key, started = self._key(cache, key, backend, call["backend_context"].target)
        entry = cache.get(kc_key)
        if entry is None:
            claim = cache.claim(kc_key)
            if claim.entry is None:
                self.counters.count("misses")
                start = time.perf_counter()
                try:
                    walk = recording.walk_start(cache, pre, started)
                    with recording.capturing(started=walk) as calls:
                        kernel = self._compile(call)
                except BaseException:
                    claim.fail()  # the waiters go on
                    raise
                published = Published(pre, kc_key, started, recording.meta(calls))
                self._hand_back(cache, claim, kernel, call, published, time.perf_counter() - start)
                return kc_key, None, kernel
            entry = claim.entry
        recording.record_later(cache, pre, kc_key, entry, started, False)
        return kc_key, entry, None

    def _hand_back(
        self,
        cache: Cache,
        claim: Claim,
        kernel: Any,
        call: dict[str, Any],
        published: Published,
        seconds: float,
    ) -> None:
        """Pack and publish ``kernel``'s entry through ``claim`` after the kernel is handed
        back (issue 23): TileLang's writers link its library again (~0.2 s of a ~1.4 s
        compile), which the caller need not wait for; the waiters get the entry as before.
        A non-daemon thread: the process ends after it (:func:`recording.wait` joins it)."""
        claim.hand_over()

        def publish() -> None:
            start = time.perf_counter()
            try:
                entry = pack(self.upstream, kernel, call["verbose"], published.meta)
                entry = claim.publish(entry, seconds=seconds + time.perf_counter() - start)
            except _STORE_ERRORS as exc:  # the kernel stays usable; the next process compiles
                self.counters.count("unpublished")
                logger.warning(
                    "kernelcache: TileLang kernel %s not stored (%s)", published.key, exc
                )
                return
            finally:
                claim.abandon()  # a no-op once published; else the waiters go on
            recording.record_now(
                cache, published.pre, published.key, entry, published.started, True
            )

        recording.in_background(publish, "kernelcache-tilelang-publish")

    def _first_run(
        self, cache: Cache, key: str, backend: str, call: dict[str, Any]
    ) -> tuple[str, Any]:
        """``(key, entry found or kernel compiled here)`` while the key's fields are still
        being derived: the compile starts, the key is decided before nvcc runs
        (:mod:`kernelcache.tilelang.firstrun`)."""
        target = call["backend_context"].target
        run = FirstRun(cache, lambda: self._key(cache, key, backend, target))
        start = time.perf_counter()
        try:
            with recording.capturing(decide=run.decide) as calls:
                kernel = self._compile(call)
        except BaseException as exc:
            found = run.outcome(exc)
            # Found by the walk: its manifest, for the next process (as _lookup does).
            recording.record_later(cache, run.pre, str(run.key), found, run.started, False)
            return str(run.key), found
        if not run.decided:  # no nvcc run went through compile_cuda: keyed now
            _, kc_key, _ = self._key(cache, key, backend, target)
            self.counters.count("misses")
            cache.get_or_compile(kc_key, lambda: pack(self.upstream, kernel, call["verbose"]))
            return kc_key, kernel
        if run.claim is None:
            return str(run.key), kernel  # TileLang went on after decide() ended it: kept as is
        self.counters.count("misses")
        published = Published(run.pre, str(run.key), run.started, recording.meta(calls))
        self._hand_back(cache, run.claim, kernel, call, published, time.perf_counter() - start)
        return str(run.key), kernel

    def _key(
        self, cache: Cache, key: str, backend: str, target: Any
    ) -> tuple[str | None, str, int | None]:
        """``(pre-key, key, walk start)``: the key from the header manifest when a variant
        holds (no walk, start ``None``), else from walking the header trees."""
        shared = shared_fields(backend)  # derived once for both keys
        pre = pre_key(key, backend, target, shared) if backend in manifest.BACKENDS else None
        if pre is not None:
            vouched = manifest.find(cache, pre, self.counters)
            if vouched is not None:
                self.counters.count("manifest_hits")
                return pre, vouched, None
        started = time.time_ns()
        return pre, kernel_key(key, backend, target, shared), started

    def _compile(self, call: dict[str, Any]) -> Any:
        from tilelang.jit import JITKernel

        context = call["backend_context"]
        kernel = JITKernel(
            call["func"],
            out_idx=call["out_idx"],
            execution_backend=context.execution_backend.name,
            target=context.target,
            target_host=context.target_host,
            verbose=call["verbose"],
            pass_configs=call["pass_configs"],
            compile_flags=call["compile_flags"],
            **shapes.context_kwargs(context),
        )
        self.counters.count("compiles")
        return kernel

    def save(self, key: str, kernel: Any, func: Any = None, verbose: bool = False) -> None:
        # Reached only after TileLang compiled itself, i.e. for what load() passed through.
        backend = kernel.execution_backend
        if not handles(backend, kernel.target):
            self.original_save(key, kernel, func, verbose)
            return
        self.cache().put(
            kernel_key(key, backend, kernel.target), pack(self.upstream, kernel, verbose)
        )
