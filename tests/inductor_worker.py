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
    equal = []
    if mode in ("infer", "both"):
        equal.append(infer())
    if mode in ("train", "both"):
        equal.append(train())
    if save := os.environ.get("KC_TEST_SAVE_ARTIFACTS"):
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None
        with open(save, "wb") as f:
            f.write(saved[0])
    return {
        "equal": all(equal),
        "inductor": dict(counters["inductor"]),
        "aot": dict(counters["aot_autograd"]),
        "kc": kci.stats(),
        "cpp": cpp.stats(),
        # The compile time the cache's statistics count, and the compile times its entries hold.
        "compile": kci.get_cache().compile_stats() if kci.installed() else {},
        "stored_seconds": stored_seconds() if kci.installed() else 0.0,
    }


def stored_seconds() -> float:
    """The sum of the ``compile_seconds`` that the local tier's entries hold."""
    total = 0.0
    for tier in kci.get_cache().tiers:
        if tier.local_dir is not None:
            for info in tier.scan():
                entry = tier.get(info.key)
                total += float(entry.meta.get("compile_seconds", 0.0)) if entry else 0.0
    return total


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
