"""JAX on CPU: a transformer block's compile with kernelcache vs JAX's own persistent cache, one run.

Each "machine" is a fresh process with its own kernelcache directory; the
team tier is a redis-server this benchmark starts on a free 127.0.0.1 port.
The model: a training step (loss and gradients) of a small pre-norm
transformer, ``--layers`` blocks unrolled, whose XLA compile takes seconds on
CPU; one ``jax.jit`` module. Measured: the first call's wall time (compile or
cache load, plus one step), for

- cold: JAX alone, no persistent cache;
- JAX dir, 1st / JAX dir hit: JAX's own directory cache
  (``jax_compilation_cache_dir``), written by one process, read by a second;
- kernelcache cold: ``kernelcache.jax.install()``, an empty signed team tier;
- kernelcache team hit: a fresh machine (fresh local directory) on the
  team's Redis, after the cold machine filled it;
- the stampede: four processes released together against an empty cache,
  JAX's shared directory vs kernelcache's team tier (compiles by JAX's own
  events, wall time from the release to the last exit).

Every side caches every module (``jax_persistent_cache_min_compile_time_secs=0``),
so a loaded machine's timing never decides what is cached. A first, unmeasured
machine compiles before them all (the page cache). With ``--repeat N`` the
cold and hit rows are medians of N runs, the two sides interleaved. Prints a
table, the ratios and a verdict per target of issue 36. One command:
``python benchmarks/bench_jax.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import results as shared  # benchmarks/results.py: the one --json shape
from redis_server import RedisServer

STAMPEDE = 4
SECRET = "bench-jax-secret"
EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "writes",  # JAX's name for a write
}


# The child: one machine's first call ------------------------------------------------
def _params(layers: int, width: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)

    def dense(*shape: int) -> Any:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    blocks = [
        {
            "qkv": dense(width, 3 * width),
            "out": dense(width, width),
            "up": dense(width, 4 * width),
            "down": dense(4 * width, width),
        }
        for _ in range(layers)
    ]
    return blocks, rng.standard_normal((8, 64, width)).astype(np.float32)


def _step(heads: int) -> Any:
    import jax
    import jax.numpy as jnp

    def norm(x: Any) -> Any:
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

    def block(p: dict[str, Any], x: Any) -> Any:
        b, t, d = x.shape
        q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v))
        mask = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // heads), -1e9)
        att = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + att @ p["out"]
        return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]

    def loss(params: list[dict[str, Any]], x: Any) -> Any:
        for p in params:  # unrolled: one block per layer in the module
            x = block(p, x)
        return (x**2).mean()

    return jax.jit(jax.value_and_grad(loss))


def child(mode: str, layers: int, go: str) -> None:
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    import jax

    counts = dict.fromkeys(EVENTS.values(), 0)

    def listen(event: str, **kwargs: str | int) -> None:
        if event in EVENTS:
            counts[EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    installed = "jax"
    if mode == "kernelcache":
        import kernelcache.jax

        assert kernelcache.jax.install()
        installed = "kernelcache.jax.install()"
    params, x = _params(layers, 128)
    step = _step(4)
    jax.block_until_ready(jax.device_put((params, x)))  # type: ignore[no-untyped-call]
    if go:
        deadline = time.monotonic() + 600
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(go)
            time.sleep(0.005)
    start = time.perf_counter()
    value, _grads = jax.block_until_ready(step(params, x))  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "loss": float(value), "installed": installed, **counts}))


# The parent: machines, scenarios, verdicts -------------------------------------------
class Machines:
    def __init__(self, root: Path, redis_port: int, layers: int) -> None:
        self.root, self.port, self.layers, self.count = root, redis_port, layers, 0

    def new(self) -> Path:
        self.count += 1
        home = self.root / f"m{self.count}"
        home.mkdir(parents=True)
        return home

    def env(self, home: Path, mode: str, where: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELCACHE_", "JAX_"))}
        env.update(
            PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"),
            KERNELCACHE_DIR=str(home / "kc"),
        )
        if mode == "jax-dir":
            env["JAX_COMPILATION_CACHE_DIR"] = where  # shared by the machines that use it
        elif mode == "kernelcache":
            env.update(
                KERNELCACHE_REMOTE=f"redis://127.0.0.1:{self.port}/0?namespace={where}",
                KERNELCACHE_SECRET=SECRET,
            )
        return env

    def start(self, home: Path, mode: str, where: str = "", go: str = "") -> Any:
        cmd = [sys.executable, __file__, "--child", mode, str(self.layers), go]
        return subprocess.Popen(
            cmd, env=self.env(home, mode, where), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(self, mode: str, where: str = "") -> dict[str, Any]:
        return _finish(self.start(self.new(), mode, where))


def _finish(proc: Any) -> dict[str, Any]:
    out, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"a machine failed:\n{err[-4000:]}")
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def stampede(machines: Machines, mode: str, where: str) -> dict[str, Any]:
    go = str(machines.root / f"go-{mode}")
    procs = [machines.start(machines.new(), mode, where, go) for _ in range(STAMPEDE)]
    time.sleep(15)  # the children import JAX before the barrier
    start = time.perf_counter()
    Path(go).touch()
    reports = [_finish(p) for p in procs]
    return {
        "wall": time.perf_counter() - start,
        "writes": sum(r["writes"] for r in reports),
        "hits": sum(r["hits"] for r in reports),
        "losses": {r["loss"] for r in reports},
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda run: float(run["seconds"]))
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "runs_s": [run["seconds"] for run in runs]}


def bench(machines: Machines, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    machines.run("jax")  # unmeasured: the page cache, for both sides
    colds, ours, jax_hits, team_hits = [], [], [], []
    for attempt in range(repeat):  # interleaved: load changes reach both sides alike
        colds.append(machines.run("jax"))
        ours.append(machines.run("kernelcache", f"cold{attempt}"))
        folder = str(machines.root / f"jax-dir-{attempt}")
        first = machines.run("jax-dir", folder)
        jax_hits.append(machines.run("jax-dir", folder))
        team_hits.append(machines.run("kernelcache", f"cold{attempt}"))
    out["cold"] = _median(colds)
    out["kernelcache cold"] = _median(ours)
    out["JAX dir, 1st"] = first
    out["JAX dir hit"] = _median(jax_hits)
    out["kernelcache team hit"] = _median(team_hits)
    out["stampede JAX dir"] = stampede(machines, "jax-dir", str(machines.root / "jax-stampede"))
    out["stampede kernelcache"] = stampede(machines, "kernelcache", "stampede")
    return out


def verdicts(r: dict[str, Any]) -> list[dict[str, str]]:
    def sec(name: str) -> float:
        return float(r[name]["seconds"])

    hit, local = sec("kernelcache team hit"), sec("JAX dir hit")
    cold_ratio = sec("kernelcache cold") / sec("cold")
    kc, jd = r["stampede kernelcache"], r["stampede JAX dir"]
    return [
        {"target": "team hit on a fresh machine <= JAX's own local hit", "measured":
         f"{hit:.3f} s vs {local:.3f} s ({hit / local:.2f}x)",
         "verdict": "PASS" if hit <= local else "MISS"},
        {"target": "cold through kernelcache <= 1.05x JAX alone", "measured":
         f"{cold_ratio:.3f}x", "verdict": "PASS" if cold_ratio <= 1.05 else "MISS"},
        {"target": f"{STAMPEDE} processes at once compile once (JAX dir: {jd['writes']})",
         "measured": f"{kc['writes']} compile(s), wall {kc['wall']:.1f} s vs {jd['wall']:.1f} s "
         f"({kc['wall'] / jd['wall']:.2f}x)",
         "verdict": "PASS" if kc["writes"] == 1 and kc["wall"] <= jd["wall"] else "MISS"},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks, unrolled")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cold and hit row")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "LAYERS", "GO"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    started = shared.machine()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    import jax

    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="kc-bench-jax-") as tmp:
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        try:
            results = bench(Machines(Path(tmp), server.port, args.layers), args.repeat)
        finally:
            server.stop()
    print("| scenario | first call s | JAX hits | JAX writes |\n|---|---|---|---|")
    for name, row in results.items():
        if "seconds" in row:
            print(f"| {name} | {row['seconds']:.3f} | {row['hits']} | {row['writes']} |")
        else:
            print(f"| {name} (x{STAMPEDE}) | wall {row['wall']:.2f} | {row['hits']} | "
                  f"{row['writes']} |")  # fmt: skip
            if len(row["losses"]) != 1:
                raise RuntimeError(f"{name}: the processes disagree on the loss")
            row["losses"] = sorted(row["losses"])
    for name in ("cold", "kernelcache cold", "JAX dir hit", "kernelcache team hit"):
        runs = ", ".join(f"{s:.3f}" for s in results[name]["runs_s"])
        print(f"{name}, each run (s): {runs}")
    losses = {results[n]["loss"] for n in results if "loss" in results[n]}
    if len(losses) != 1:
        raise RuntimeError(f"the machines disagree on the loss: {sorted(losses)}")
    table = verdicts(results)
    print(f"\nmedian of {args.repeat}; cold compile {results['cold']['seconds']:.2f} s")
    print("\n| target (issue 36) | measured | verdict |\n|---|---|---|")
    print("\n".join(f"| {t['target']} | {t['measured']} | {t['verdict']} |" for t in table))
    doc = shared.document(
        "bench_jax",
        contenders=["JAX alone", "JAX's directory cache", "kernelcache.jax (team tier: Redis)"],
        targets=table,
        details=results,
        started=started,
    )
    shared.write(args.json, doc)


if __name__ == "__main__":
    main()
