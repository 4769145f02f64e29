"""One process of the shared-filesystem stress (tests/test_netfs_modes.py, benchmarks/bench_netfs.py).

    python netfs_worker.py KIND DIR OPS KEYS CAP SEED GO COMPILE_MS PROCS

Asks a cache of kind KIND (``kernelcache``, ``triton`` or ``diskcache``) in DIR
for OPS random keys out of KEYS, compiling a miss (a sleep of COMPILE_MS, then
the key's known bytes) and putting it, under a cap of CAP bytes where the
cache has one. Starts when the file GO exists (children.wait_for); churns
only once all PROCS processes are through the stampede (so that no eviction
makes a late one compile a stampede key again); then
prints one JSON line: calls, wrong bytes returned, exceptions that reached
the caller (by type and errno), compiles per key (of the stampede, and all).

Every exception out of the cache is counted, whatever its type: that it
reached the caller is the finding.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from children import wait_for

ARTIFACT = "kernel.cubin"


def key_name(i: int, phase: str = "churn") -> str:
    return hashlib.sha256(f"netfs-{phase}-{i}".encode()).hexdigest()


#: The stampede's values are small, so that no eviction can make a late process
#: compile a key again: every compile past the first is single-flight's failure.
STAMPEDE_SIZE = 256


def value_of(key: str, size: int = 0) -> bytes:
    """The bytes a compile of ``key`` gives: ``size`` bytes, else 4 to 11 KiB; known to every process."""
    size = size or 4096 * (1 + int(key[:2], 16) % 2) + 1024 * (int(key[2:4], 16) % 4)
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


Compile = Callable[[], bytes]


class Kernelcache:
    """``kernelcache.Cache`` over one DiskStore with a byte cap: ``get_or_compile``."""

    def __init__(self, path: str, cap: int) -> None:
        from kernelcache import Cache, Entry
        from kernelcache.stores import DiskStore

        self._entry = Entry
        self.store = DiskStore(path, max_bytes=cap)
        self.cache = Cache([self.store])

    def counters(self) -> dict[str, int]:
        """The disk tier's integer counters (errors, lock waits, ...), for diagnosis."""
        return {
            k: v
            for k, v in self.store.stats().items()
            if isinstance(v, int) and not isinstance(v, bool)
        }

    def get_or_compile(self, key: str, compile_fn: Compile) -> bytes:
        entry = self.cache.get_or_compile(key, lambda: self._entry({ARTIFACT: compile_fn()}))
        return entry[ARTIFACT]


class Triton:
    """Triton's ``FileCacheManager`` as Triton's compiler uses it: a group lookup, else compile and put."""

    def __init__(self, path: str, cap: int) -> None:
        os.environ["TRITON_CACHE_DIR"] = path  # no cap: Triton never evicts
        from triton.runtime.cache import FileCacheManager

        self.manager = FileCacheManager

    def get_or_compile(self, key: str, compile_fn: Compile) -> bytes:
        manager = self.manager(key)
        group = manager.get_group(f"{key}.json")
        if group is not None and ARTIFACT in group:
            with open(group[ARTIFACT], "rb") as f:
                data: bytes = f.read()
            return data
        data = compile_fn()
        path = manager.put(data, ARTIFACT, binary=True)
        manager.put_group(f"{key}.json", {ARTIFACT: path})
        return data


class DiskCache:
    """``diskcache.Cache`` with ``size_limit``: get, else compile and set."""

    def __init__(self, path: str, cap: int) -> None:
        import diskcache

        self.cache = diskcache.Cache(path, size_limit=cap)

    def get_or_compile(self, key: str, compile_fn: Compile) -> bytes:
        data = self.cache.get(key)
        if isinstance(data, bytes):
            return data
        data = compile_fn()
        self.cache.set(key, data)
        return data


def crashing_once(path: str, cap: int) -> Kernelcache:
    """The first process to open it dies of SIGBUS, as a diskcache worker on a network
    filesystem can; the others use kernelcache (tests/test_netfs_modes.py)."""
    try:
        os.close(os.open(f"{path}.crashed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return Kernelcache(path, cap)
    os.kill(os.getpid(), signal.SIGBUS)
    raise AssertionError("SIGBUS did not end the process")


KINDS: dict[str, Callable[[str, int], Any]] = {
    "kernelcache": Kernelcache,
    "triton": Triton,
    "diskcache": DiskCache,
    "crashing-once": crashing_once,
}


def describe(exc: BaseException) -> str:
    """The exception's type and errno, or its message without the quoted keys and paths."""
    code = getattr(exc, "errno", None)
    text = os.strerror(code) if isinstance(code, int) else re.sub(r"'[^']*'", "...", str(exc))[:60]
    return f"{type(exc).__name__}: {text}"


def run(
    kind: str, path: str, ops: int, keys: int, cap: int, seed: int, compile_ms: float,
    between: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """First every stampede key once, in the same order in every process (the
    compiles per key count there), then ``ops`` random keys (churn under the cap)."""
    rnd = random.Random(seed)
    compiles: Counter[str] = Counter()
    escaped: Counter[str] = Counter()
    wrong = 0
    slowest = 0.0  # the longest call, less its own compile: how long a caller waited on others
    try:
        cache = KINDS[kind](path, cap)
    except Exception as exc:  # opening the cache is part of what the caller sees
        if between is not None:
            between()  # through the stampede (none): the others must not wait for us
        return {
            "calls": 0,
            "wrong": 0,
            "escaped": {describe(exc): 1},
            "stampede": {},
            "compiles": {},
        }
    order = [(key_name(i, "stampede"), STAMPEDE_SIZE) for i in range(keys)]
    order += [(key_name(rnd.randrange(keys)), 0) for _ in range(ops)]
    for n, (key, size) in enumerate(order):
        if n == keys and between is not None:
            between()

        compiled = [0.0]

        def compile_fn(key: str = key, size: int = size, compiled: list[float] = compiled) -> bytes:
            compiles[key] += 1
            began = time.monotonic()
            time.sleep(compile_ms / 1000)
            compiled[0] += time.monotonic() - began
            return value_of(key, size)

        began = time.monotonic()
        try:
            data = cache.get_or_compile(key, compile_fn)
        except Exception as exc:  # every exception that reaches the caller is counted
            escaped[describe(exc)] += 1
            continue
        finally:
            slowest = max(slowest, time.monotonic() - began - compiled[0])
        wrong += data != value_of(key, size)
    stampede = {key: compiles[key] for key, size in order[:keys]}
    counters = cache.counters() if isinstance(cache, Kernelcache) else {}
    return {
        "counters": counters,
        "calls": len(order),
        "wrong": wrong,
        "escaped": dict(escaped),
        "stampede": stampede,
        "compiles": dict(compiles),
        "slowest": slowest,
    }


def barrier(stem: str, count: int, wait: float = 120.0) -> None:
    """Mark this process through, then wait (at most ``wait`` s: a hung one must not
    hang the rest) until ``count`` processes are."""
    with open(f"{stem}.{os.getpid()}", "w"):
        pass
    folder, name = os.path.split(stem)
    deadline = time.monotonic() + wait
    while (
        sum(f.startswith(f"{name}.") for f in os.listdir(folder)) < count
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    kind, path, ops, keys, cap, seed, go, compile_ms, procs = argv
    wait_for(go)
    report = run(
        kind, path, int(ops), int(keys), int(cap), int(seed), float(compile_ms),
        lambda: barrier(f"{go}.stampede", int(procs)),
    )  # fmt: skip
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
