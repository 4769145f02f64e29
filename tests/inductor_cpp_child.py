"""One "machine" compiling a linear layer and a ReLU with torch.compile on CPU, C++ builds
through kernelcache: the ISA probe's ``.so`` and one kernel's (each kernel more would only
cost another ~5 s of g++ per cold machine).

Run by tests/test_inductor_cpp.py with its own TORCHINDUCTOR_CACHE_DIR and
TMPDIR (torch's precompiled headers live under the temporary directory), its
own local disk tier at argv[2] and a team tier at argv[1] shared with the other
"machines": a Redis URL, or a disk tier's folder. Prints one JSON line: the
hooks' counters and whether the outputs equal eager's.
"""

from __future__ import annotations

import json
import sys

import torch

from kernelcache import Cache
from kernelcache.inductor import cpp
from kernelcache.patching import Patches
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore
from kernelcache.stores.redis import RedisStore


def main() -> None:
    team, local = sys.argv[1:3]
    shared = RedisStore(team) if team.startswith("redis://") else DiskStore(team)
    cache = Cache([MemoryStore(), DiskStore(local), shared], persist_stats=False)
    patches = Patches()
    cpp.install(patches, lambda: cache)
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU()), torch.randn(8, 16)
    with torch.no_grad():
        got, want = torch.compile(model)(x), model(x)
    patches.restore()
    report = {"stats": cpp.stats(), "equal": bool(torch.allclose(got, want, atol=1e-6))}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
