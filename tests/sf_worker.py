"""A process asking a real cache directory for one key through get_or_compile.

Run by tests/test_singleflight.py and tests/test_stats.py as
``python sf_worker.py JSON`` with a JSON object of options:

    dir, key         the cache directory and key
    counter          file the compile function appends one line to per run
    go               wait for this file to exist before asking (a start barrier)
    mode             "ok" | "fail" (raise after sleeping) | "hang" (mark started, sleep)
    sleep            seconds the compile takes
    timeout          get_or_compile timeout
    started          file created when the compile function starts
    gate             the compile function waits for this file before going on
    hits             extra cache.get calls after the entry is there (for stats tests)
    asked_dir        each process makes a file here once it asked (after ``go``) ...
    quorum           ... and a compile waits until this many are there: every process
                     asks before the compile ends, however late a loaded machine ran it
    api              "get_or_compile" (default) | "claim": get, claim, compile, publish
                     as separate calls (how an integration like Triton's manager uses it)

Prints "ready" once imported, then one JSON line: the entry's digest, whether
this process compiled, and CLOCK_MONOTONIC times (comparable across processes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import xxhash

from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings


def main() -> int:
    opts = json.loads(sys.argv[1])
    cache = Cache([MemoryStore(), DiskStore(opts["dir"])], settings=Settings.load(dir=opts["dir"]))
    compiled: dict[str, float | None] = {"start": None, "end": None}

    def compile_fn() -> bytes:
        compiled["start"] = time.monotonic()
        fd = os.open(opts["counter"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        if opts.get("started"):
            open(opts["started"], "w").close()
        while opts.get("gate") and not os.path.exists(opts["gate"]):
            time.sleep(0.001)
        deadline = time.monotonic() + 60
        while opts.get("quorum") and len(os.listdir(opts["asked_dir"])) < opts["quorum"]:
            assert time.monotonic() < deadline, "the other processes never asked"
            time.sleep(0.001)
        time.sleep(opts.get("sleep", 0.0))
        if opts.get("mode") == "fail":
            raise RuntimeError("compile failed on purpose")
        if opts.get("mode") == "hang":
            time.sleep(3600)
        compiled["end"] = time.monotonic()
        return os.urandom(4096)  # a different result per compile exposes double compiles

    print("ready", flush=True)
    if opts.get("go"):
        while not os.path.exists(opts["go"]):
            time.sleep(0.001)
    asked = time.monotonic()
    if opts.get("asked_dir"):
        open(os.path.join(opts["asked_dir"], str(os.getpid())), "w").close()
    try:
        if opts.get("api") == "claim":
            entry = by_claim(cache, opts["key"], compile_fn, opts.get("timeout", 30.0))
        else:
            entry = cache.get_or_compile(opts["key"], compile_fn, timeout=opts.get("timeout", 30.0))
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc), "asked": asked}), flush=True)
        return 0
    returned = time.monotonic()
    for _ in range(opts.get("hits", 0)):
        cache.get(opts["key"])
    result = {
        "digest": xxhash.xxh3_128_hexdigest(entry["data"]),
        "compiled": compiled["start"] is not None,
        "compile_end": compiled["end"],
        "asked": asked,
        "returned": returned,
        "pid": os.getpid(),
    }
    cache.close()
    print(json.dumps(result), flush=True)
    return 0


def by_claim(cache: Cache, key: str, compile_fn: Callable[[], bytes], timeout: float) -> Entry:
    entry = cache.get(key)
    if entry is not None:
        return entry
    claim = cache.claim(key, timeout=timeout)
    if claim.entry is not None:
        return claim.entry
    try:
        data = compile_fn()
    except RuntimeError:
        claim.abandon()
        raise
    return claim.publish(data)


if __name__ == "__main__":
    sys.exit(main())
