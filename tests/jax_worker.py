"""A child process of tests/test_jax.py: one real ``jax.jit`` compile on CPU.

    python jax_worker.py [GO_FILE]

``KC_TEST_INSTALL``: ``1`` (default) calls ``kernelcache.jax.install()``;
``0`` leaves it to ``KERNELCACHE_JAX=1``; ``uninstall`` installs, then
uninstalls before compiling (JAX's own cache, ``KC_TEST_JAX_DIR``, must work).
``KC_TEST_JAX_DIR`` sets ``jax_compilation_cache_dir``. Every module is cached
(``jax_persistent_cache_min_compile_time_secs=0``) and every warning is an
error: a "persistent cache error" warning from JAX fails the child. With
GO_FILE, the child waits for that file (the parent releases several at once).
Its last line is a JSON report: JAX's own cache events (hits, and writes,
which JAX names ``cache_misses``), ``kernelcache.jax.stats()``, the cache's
compile statistics, and whether the result equals numpy's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter
from typing import Any

import numpy as np

warnings.simplefilter("error")
# JAX reads its switches from the environment when it defines them (at import).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
if folder := os.environ.get("KC_TEST_JAX_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import children  # noqa: E402

EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "writes",
}


def block(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w1) @ w2 + x.sum()


def reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return np.tanh(x @ w1) @ w2 + x.sum()  # type: ignore[no-any-return]


def main(argv: list[str]) -> dict[str, Any]:
    events: Counter[str] = Counter()

    def listen(event: str, **kwargs: str | int) -> None:
        if event in EVENTS:
            events[EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    mode = os.environ.get("KC_TEST_INSTALL", "1")
    import kernelcache.jax as kcj

    if mode in ("1", "uninstall"):
        assert kcj.install()
    if mode == "uninstall":
        kcj.uninstall()
    if argv:
        children.wait_for(argv[0])
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 16), (16, 8)))
    got = np.asarray(jax.jit(block)(x, w1, w2))
    return {
        "equal": bool(np.allclose(got, reference(x, w1, w2), rtol=1e-5, atol=1e-5)),
        "jax": {"hits": events["hits"], "writes": events["writes"]},
        "kc": kcj.stats(),
        "installed": kcj.installed(),
        "compile": kcj.get_cache().compile_stats() if kcj.installed() else {},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
