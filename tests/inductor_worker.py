"""A child process of tests/test_inductor.py: torch.compile on CPU through kernelcache.inductor.

    python inductor_worker.py MODE [GO_FILE]

MODE ``infer``: a model's inference graph; ``train``: the same model's forward and
backward; ``both``: one then the other. The model: two bias-free linear layers,
which Inductor compiles to matrix multiplies only (no C++ kernel, so no g++ run:
~5 s of CPU less per kernel on a cold machine, and ~4 s for the ISA probe), or with
``KC_TEST_MODEL=mlp`` an MLP whose ReLU is a C++ kernel (a ``.so`` per graph, and
a compile long enough for a race). With GO_FILE, the child waits for that file
(the parent releases several children at once). With KC_TEST_SAVE_ARTIFACTS
set, it writes torch's Mega-Cache blob there. Its last line of output
is a JSON report: torch's cache counters, kernelcache.inductor.stats(), the C++
build hooks' counters, whether outputs and gradients equal eager mode's, and the
compile seconds the cache counted against those its entries hold.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import children
import kernelcache.inductor as kci
from kernelcache.inductor import cpp


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    if os.environ.get("KC_TEST_MODEL") == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 4, bias=False)
    )


def infer() -> bool:
    eager = model().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        return bool(torch.equal(torch.compile(eager)(x), eager(x)))


def train() -> bool:
    eager, compiled = model(), model()
    x = torch.randn(4, 8)
    eager(x).pow(2).sum().backward()
    torch.compile(compiled)(x).pow(2).sum().backward()
    grads = [
        (a.grad, b.grad) for a, b in zip(eager.parameters(), compiled.parameters(), strict=True)
    ]
    return all(
        a is not None and b is not None and torch.allclose(a, b, atol=1e-6) for a, b in grads
    )


def main(argv: list[str]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    mode = argv[0]
    if os.environ.get("KC_TEST_INSTALL", "1") == "1":
        kci.install()
    if len(argv) > 1:
        children.wait_for(argv[1])
    equal: list[bool] = []
    calls: dict[str, dict[str, float]] = {}
    for name, call in (("infer", infer), ("train", train)):
        if mode in (name, "both"):
            equal.append(timed(call, calls.setdefault(name, {})))
    if save := os.environ.get("KC_TEST_SAVE_ARTIFACTS"):
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None
        with open(save, "wb") as f:
            f.write(saved[0])
    held, builds, nested = held_seconds()
    return {
        "equal": all(equal),
        "inductor": dict(counters["inductor"]),
        "aot": dict(counters["aot_autograd"]),
        "kc": kci.stats(),
        "cpp": cpp.stats(),
        # The compile time the cache's statistics count, and the compile times its entries hold.
        "compile": kci.get_cache().compile_stats() if kci.installed() else {},
        "stored_seconds": sum(seconds for _, seconds in held),
        # The compile times that AOTAutograd's entries hold (its FX graphs' included).
        "aot_seconds": [seconds for cache, seconds in held if cache == "autograd-experimental"],
        # C++ builds that no entry names as compiled inside it (built outside every graph's
        # compile, or, with compile threads, not counted as inside it).
        "builds": len(builds),
        "unnested_builds": len(builds - nested),
        "calls": calls,
    }


def timed(call: Callable[[], bool], report: dict[str, float]) -> bool:
    """Run ``call``; ``report`` gets its wall time and the seconds the cache says it saved."""
    before, start = seconds_saved(), time.perf_counter()
    result = call()
    report["wall"] = time.perf_counter() - start
    report["saved"] = seconds_saved() - before
    return result


def seconds_saved() -> float:
    """The compile seconds this process's hits saved, by the cache's statistics."""
    if not kci.installed():
        return 0.0
    return float(sum(tier["seconds_saved"] for tier in kci.get_cache().stats().values()))


def held_seconds() -> tuple[list[tuple[str, float]], set[str], set[str]]:
    """The local tier's entries that hold a ``compile_seconds``: which of torch's caches
    each belongs to ("" for a C++ build), and those seconds; the keys of the C++ builds;
    the keys that entries name as compiled inside them."""
    held, builds, nested = [], set(), set()
    for tier in kci.get_cache().tiers if kci.installed() else ():
        if tier.local_dir is not None:
            for info in tier.scan():
                entry = tier.get(info.key)
                if entry is None or "compile_seconds" not in entry.meta:
                    continue
                held.append((entry.meta.get("torch_cache", ""), entry.meta["compile_seconds"]))
                if entry.meta.get("kind") in ("so", "o"):
                    builds.add(info.key)
                nested.update(entry.meta.get("nested", ()))
    return held, builds, nested


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
