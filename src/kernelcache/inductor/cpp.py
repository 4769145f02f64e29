"""Inductor's C++ builds through kernelcache: kernels, precompiled headers, ISA probes.

On CPU, torch.compile turns each graph into C++ kernels that g++ builds into
``.so`` files, one ``CppBuilder.build()`` each, under ``TORCHINDUCTOR_CACHE_DIR``.
An FX-graph hit (local or remote) holds only their source, so a second machine
still runs g++ for every kernel, plus, before its first graph, the ISA probes
(a small ``.so`` per vector ISA) and a precompiled header (~150 MB, ~9 s here).

:func:`install` makes every build one kernelcache entry keyed by what it
reads (:mod:`kernelcache.inductor.cpp_keys`): a hit writes the verified bytes
where torch expects its output and runs no compiler; N processes or machines
that miss the same build at once compile it once (:meth:`Cache.claim`).

The precompiled header becomes lazy and is not stored: torch asks for it
before every new kernel, but it only speeds up a compile, so it is built only
when a build actually misses. Stored, it would be ~150 MB per flag set in
every tier, and ~1 s more on every cold machine to store it, for the benefit
of machines that miss a kernel anyway (which then pay torch's ~9 s).

A build is first looked up by its *direct key*, without running anything:
the manifest there lists, per variant, the headers a build read with their
digests, and a variant whose headers are unchanged gives the entry
(:mod:`kernelcache.inductor.cpp_manifest`, ccache's direct mode). A hit so
runs no g++ at all, on any machine. Only on a miss there (a new build, a
header changed, another header layout) does the key of
:mod:`kernelcache.inductor.cpp_keys` run its header scan: once per machine and
boot, one ``g++ -E -fdirectives-only`` per distinct flag set (~0.1-0.3 s, then
remembered by the headers' stats: :mod:`kernelcache.inductor.headers`), and
``g++ -v`` once per process for what ``-march=native`` means here. Each ISA
probe's ``dlopen`` still runs in a child Python (whether this CPU runs the code).

torch has no seam for builds, so the hooks replace three names (the table
below, probed as :data:`SEAMS` whatever torch's version: :mod:`kernelcache.versions`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from kernelcache import _fs
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.inductor import cpp_manifest
from kernelcache.inductor.cpp_keys import (
    Build,
    HeaderScans,
    Uncacheable,
    direct_key,
    keyed,
    missing_fields,
    read_inputs,
)
from kernelcache.inductor.headers import Load, Save, Scan
from kernelcache.patching import Patches
from kernelcache.singleflight import carried
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.sqlite import SQLiteStore
from kernelcache.versions import Seam, missing_seams

__all__ = ["SEAMS", "install", "stats"]

# The seams, all read from torch 2.13.0:
# torch._inductor.cpp_builder.CppBuilder.build: runs one compiler command. Its
#   private fields (_sources_args, _include_dirs_args, _definitions_args,
#   _cflags_args, _passthrough_parameters_args, _precompiling, _compile_only,
#   _preprocessing, _use_relative_path) describe the build (cpp_keys.Build).
# torch._inductor.codecache._precompile_header: preprocesses and precompiles a
#   header, returns the path to pass with -include.
# torch._inductor.async_compile.AsyncCompile.submit (a classmethod): hands a task
#   (a graph's C++ builds among them) to the compile threads' pool, or runs it.
BUILD = "build"
PRECOMPILE = "_precompile_header"
HEADER_DIR = "_HEADER_DIR"  # codecache: where torch keeps precompiled headers
# CppBuilder fields: "-include" and the rest of the include arguments; whether
# the build is one of fbcode's remote builds; whether it only preprocesses.
INCLUDES, REMOTE, PREPROCESSING = "_include_dirs_args", "_use_relative_path", "_preprocessing"
PRECOMPILING = "_precompiling"  # the build makes a precompiled header
SUBMIT = "submit"
#: What :func:`install` needs of the installed torch; without one of them, no C++ hooks.
SEAMS: tuple[Seam, ...] = (
    f"torch._inductor.cpp_builder:CppBuilder.{BUILD}",
    f"torch._inductor.codecache:{PRECOMPILE}",
    f"torch._inductor.codecache:{HEADER_DIR}",
    f"torch._inductor.async_compile:AsyncCompile.{SUBMIT}",
)

#: The one artifact of an entry: the build's output file.
ARTIFACT = "output"
MEMO = "headers.json"  # the one artifact of a header-scan memo
COUNTERS = (
    "hits", "direct_hits", "misses", "compiles", "uncached", "pch_deferred", "pch_built",
)  # fmt: skip


class Counters:
    """Events of the C++ build hooks in this process (:func:`stats`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(COUNTERS, 0)

    def count(self, name: str) -> None:
        with self._lock:
            self.values[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


counters = Counters()
_scans = HeaderScans()


def stats() -> dict[str, int]:
    """This process's build hits (``direct_hits``: through a manifest, no scan), misses,
    compiles, uncached builds, header scans."""
    return {**counters.snapshot(), "header_scans": _scans.runs}


_views: weakref.WeakKeyDictionary[Cache, tuple[Cache, Cache]] = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def runnable(cache: Cache) -> Cache:
    """The tiers of ``cache`` that C++ builds use: all but the memory tier.

    Torch keeps each loaded library for the process, so a memory tier would
    only hold bytes. ``cache`` is the one :mod:`kernelcache.inductor` hands
    over, with its trust rule applied (a ``.so`` is code: no unsigned team tier
    unless the user opted in).
    """
    return _views_of(cache)[0]


def local(cache: Cache) -> Cache:
    """The local tiers of ``cache`` (disk or SQLite): where header-scan memos live."""
    return _views_of(cache)[1]


def _views_of(cache: Cache) -> tuple[Cache, Cache]:
    with _views_lock:
        views = _views.get(cache)
        if views is None:
            code = [t for t in cache.tiers if not isinstance(t, MemoryStore)]
            disks = [t for t in cache.tiers if isinstance(t, (DiskStore, SQLiteStore))]
            views = (
                Cache(code, settings=cache.settings),
                Cache(disks, settings=cache.settings, persist_stats=False),
            )
            _views[cache] = views
        return views


def _memo(cache: Cache) -> tuple[Load, Save]:
    """Header-scan memos in the local tiers (machine-local records: see headers.py)."""
    tiers = local(cache)

    def load(key: str) -> bytes | None:
        entry = tiers.get(key)
        return entry[MEMO] if entry is not None and MEMO in entry else None

    def save(key: str, record: bytes) -> None:
        tiers.put(key, Entry({MEMO: record}, meta={"kind": "header-scan"}))

    return load, save


class LazyHeaders:
    """``_precompile_header`` that hands out a header path now and builds its PCH on need.

    The path names a small file holding ``#include <header>``: without a
    ``.gch`` beside it, g++ reads the header itself (same code, slower).
    :meth:`materialize` swaps in torch's real precompiled header before a
    build that has to compile.
    """

    def __init__(self, original: Callable[..., str], header_dir: str) -> None:
        self.original = original
        self.header_dir = header_dir
        self._lock = threading.Lock()
        self._deferred: dict[str, tuple[str, str, dict[str, Any]]] = {}

    def __call__(self, header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        text = f"#include <{header}>\n"
        name = hashlib.sha256(f"{text}\0{hashable_cmd_line}".encode()).hexdigest()[:40]
        path = os.path.join(self.header_dir, f"kc-{name}.h")
        with self._lock:
            if path not in self._deferred:
                os.makedirs(self.header_dir, exist_ok=True)
                if not _fs.holds(path, text.encode(), {}):
                    _fs.write_atomic(path, text.encode(), mode=0o644)
                self._deferred[path] = (header, hashable_cmd_line, compile_command)
                counters.count("pch_deferred")
        return path

    def materialize(self, builder: Any) -> None:
        """Point ``builder``'s ``-include`` at torch's real precompiled header, built now."""
        for path, (header, cmd, command) in self._pending(getattr(builder, INCLUDES)):
            real = self.original(header, cmd, **command)  # functools.cache'd by torch
            args = getattr(builder, INCLUDES).replace(f"-include {path} ", f"-include {real} ")
            setattr(builder, INCLUDES, args)

    def _pending(self, include_args: str) -> list[tuple[str, tuple[str, str, dict[str, Any]]]]:
        with self._lock:
            return [(p, d) for p, d in self._deferred.items() if f"-include {p} " in include_args]


class BuildHook:
    """``CppBuilder.build`` through the cache: a hit writes the output, a miss compiles once."""

    def __init__(
        self,
        original: Callable[[Any], None],
        get_cache: Callable[[], Cache],
        headers: LazyHeaders,
        torch_version: str,
    ) -> None:
        self.original = original
        self.get_cache = get_cache
        self.headers = headers
        self.torch_version = torch_version

    def __call__(self, builder: Any) -> None:
        if getattr(builder, REMOTE) or getattr(builder, PREPROCESSING):
            # fbcode's remote builds; torch's own preprocessing for a PCH key.
            self.original(builder)
            return
        if getattr(builder, PRECOMPILING):  # only ever built for a miss (LazyHeaders)
            counters.count("pch_built")
            self.original(builder)
            return
        if self.caches_disabled():  # TORCHINDUCTOR_FORCE_DISABLE_CACHES keeps its meaning
            counters.count("uncached")
            self._compile(builder, Build.of(builder))
            return
        build = Build.of(builder)
        whole = self.get_cache()
        cache = runnable(whole)
        try:
            inputs = read_inputs(build)
            direct: str | None = direct_key(build, self.torch_version, os.environ, inputs)
        except Uncacheable:
            inputs, direct = None, None  # the full key decides (and says why it cannot)
        if direct is not None:
            entry = cpp_manifest.lookup(cache, direct, build)
            if entry is not None:
                counters.count("hits")
                counters.count("direct_hits")
                self._place(entry, build.target)
                return
        try:
            search = cpp_manifest.search_path(build, os.environ)
            key, scan = keyed(build, _scans, self.torch_version, _memo(whole), inputs, search)
        except Uncacheable:
            counters.count("uncached")
            self._compile(builder, build)
            return
        entry = cache.get(key)
        if entry is None:
            counters.count("misses")
            with cache.claim(key) as claim:
                entry = claim.entry
                if entry is None:
                    claim.compile(lambda: self._compile(builder, build))
                    counters.count("compiles")
                    self._remember(cache, direct, build, scan, key)
                    return
        counters.count("hits")
        self._place(entry, build.target)
        self._remember(cache, direct, build, scan, key)

    @staticmethod
    def _remember(
        cache: Cache, direct: str | None, build: Build, scan: Scan | None, key: str
    ) -> None:
        """Add this build's headers to its manifest, for the next lookup's direct hit."""
        if direct is not None:
            cpp_manifest.record(cache, direct, build, scan, key, os.environ)

    @staticmethod
    def caches_disabled() -> bool:
        from torch._inductor import config

        return bool(config.force_disable_caches)

    def _compile(self, builder: Any, build: Build) -> Entry:
        self.headers.materialize(builder)
        self.original(builder)
        with open(build.target, "rb") as f:
            data = f.read()
        return Entry({ARTIFACT: data}, meta={"kind": build.kind})

    @staticmethod
    def _place(entry: Entry, target: str) -> None:
        """Write the entry's verified bytes where torch loads its output from."""
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        _fs.write_atomic(target, entry[ARTIFACT], mode=0o755)


def install(patches: Patches, get_cache: Callable[[], Cache]) -> None:
    """Route Inductor's C++ builds through ``get_cache()``; every change goes into ``patches``.

    ``get_cache`` is called per build, so a later install with another cache
    needs no re-patching. A torch without one of :data:`SEAMS`, or whose ``CppBuilder``
    lacks a field a key reads (:data:`kernelcache.inductor.cpp_keys.FIELDS`), gets no
    C++ hooks, with one warning naming it (the graph caches above still work).
    """
    import torch
    from torch._inductor import codecache, cpp_builder
    from torch._inductor.async_compile import AsyncCompile

    version = str(torch.__version__).split("+", 1)[0]
    lacking = missing_seams(SEAMS)
    if not lacking:
        lacking = [f"CppBuilder.{f}" for f in missing_fields(cpp_builder.CppBuilder)]
    if lacking:
        warnings.warn(
            f"kernelcache.inductor: torch {version} lacks {lacking[0]}: "
            "its C++ builds keep no kernelcache entries",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    headers = LazyHeaders(getattr(codecache, PRECOMPILE), getattr(codecache, HEADER_DIR))
    # The key holds the build tag too (2.15.0+cpu and +cu132 ship other headers and code).
    hook = BuildHook(getattr(cpp_builder.CppBuilder, BUILD), get_cache, headers, torch.__version__)

    def build(builder: Any) -> None:
        hook(builder)

    patches.set(codecache, PRECOMPILE, headers)
    patches.set(cpp_builder.CppBuilder, BUILD, build)
    # With compile threads (one per core by default), an FX graph's C++ builds run on
    # the pool while its compile waits: carried, they count inside its claim, as they
    # do inline. Otherwise a hit on the graph's entry, which holds the builds' time,
    # and the builds' own hits would both count it (as would their compiles).
    submit = getattr(AsyncCompile, SUBMIT).__func__

    def carrying(cls: type, task: Callable[..., Any]) -> Any:
        return submit(cls, carried(task))

    patches.set(AsyncCompile, SUBMIT, classmethod(carrying))
