"""TileLang's CUDA binary cache (``CUDABinaryCache``, 0.1.15) as kernelcache entries.

TileLang keeps nvcc's output by the device code, the nvcc options and the
target (``CUDABinaryCache.make_key``), so kernels with the same device code
share one nvcc run: sizes that only change the launch grid, one kernel for two
backends. Its key holds absolute ``-I`` paths and neither the compilers nor the
headers' content, and its files are outside kernelcache's tiers, so while
kernelcache is installed that cache is replaced, not bypassed (bypassing it
made each of those kernels run nvcc, where TileLang alone ran it once: issue
23). An entry here is the binary, keyed by TileLang's key and what it leaves
out: the header trees' content and every field kernel keys share
(:func:`kernelcache.tilelang.keys.shared_fields`: nvcc's and the host
compiler's identity, the environment nvcc reads, ...).

The nvcc call that made the binary (:func:`kernelcache.tilelang.recording.describe_call`)
is kept in its meta: a kernel built from a stored binary is noted as having
made that call, so its entry records a header manifest as a compiled one does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.integration import Counters
from kernelcache.keys import KeyBuilder
from kernelcache.tilelang import keys, recording
from kernelcache.tilelang.manifest import CALL_META

logger = logging.getLogger(__name__)

NAMESPACE = "kernelcache.tilelang.binary"
SCHEMA = 1
#: The artifact holding nvcc's output (a cubin, a fatbin or PTX).
ARTIFACT = "binary"
# Deriving the key reads the trees, the compilers and the toolchain memo.
_KEY_ERRORS = (OSError, RuntimeError, ValueError)


def binary_key(upstream_key: str, compile_format: str) -> str:
    """The kernelcache key of one binary of TileLang's CUDA binary cache."""
    builder = (
        KeyBuilder(NAMESPACE)
        .add("schema", SCHEMA)
        .add("upstream", upstream_key)
        .add("format", compile_format)
        .add("headers", keys.headers())
    )
    # The fields every kernel key shares (nvcc and the host compiler, not NVRTC). TileLang's
    # libraries among them do not change nvcc's output: a new build costs a recompile, never
    # a stale binary.
    return keys.with_shared(builder, keys.shared_fields("tvm_ffi")).hexdigest()


class BinaryHooks:
    """Replacements for ``CUDABinaryCache.load`` and ``save`` (classmethods upstream)."""

    def __init__(self, cache: Callable[[], Cache], counters: Counters) -> None:
        self.cache = cache
        self.counters = counters

    def load(self, key: str, compile_format: str) -> bytes | None:
        if not _enabled():
            return None
        try:
            entry = self.cache().get(binary_key(key, compile_format))
            data = entry[ARTIFACT] if entry is not None else None
        except (*_KEY_ERRORS, CorruptEntry, StoreError, KeyError) as exc:
            logger.info("kernelcache: TileLang binary lookup failed (%s); nvcc runs", exc)
            return None
        if not data:
            return None
        self.counters.count("binary_hits")
        calls = recording.noted()
        if calls is not None:  # as if this thread's compile had made the call
            call = entry.meta.get(CALL_META) if entry is not None else None
            calls.append(call if isinstance(call, dict) else None)
        return data

    def save(self, key: str, compile_format: str, data: bytes) -> None:
        if not data or not _enabled():
            return
        calls = recording.noted()
        call = calls[-1] if calls else None  # the nvcc call that just made ``data``
        meta: dict[str, Any] = {CALL_META: call} if call is not None else {}
        try:
            self.cache().put(
                binary_key(key, compile_format), Entry({ARTIFACT: bytes(data)}, meta=meta)
            )
        except _KEY_ERRORS as exc:
            logger.info("kernelcache: TileLang binary not stored (%s)", exc)


def _enabled() -> bool:
    """TileLang's own switch (``TILELANG_DISABLE_CACHE``, ``disable_cache()``), as upstream reads it."""
    from tilelang.env import env

    return bool(env.is_cache_enabled())
