"""Launcher single-flight: of N calls running one compile at once, one runs nvcc (issue 37).

Eight ranks that JIT one new DeepGEMM kernel at once, or ninja on eight nodes
building one FlashInfer module, ran nvcc eight times. Now a compile runs under
a claim (:meth:`kernelcache.cache.Cache.claim`, :mod:`kernelcache.singleflight`)
on the *flight key* of its direct key: the disk tier's lock file spans this
machine, a remote tier's lease spans machines, each with its liveness rules (a
lock dies with its holder; a lease expires unless renewed; a waiter whose wait
runs past :data:`TIMEOUT` compiles itself). Nothing is ever published under the
flight key: whoever takes the claim looks up the command again (the leader's
result and manifest are stored under their own keys by then) and compiles only
if it still misses.

- The in-process launcher (:mod:`kernelcache.nvcc.miss`) holds the claim
  around its lookup and compile.
- The launcher's server plans a compile for a client (:mod:`kernelcache.nvcc.compiling`)
  and holds its claim for it (:class:`Flying`), without waiting: a claim that
  finds the key busy (this server's own client, another process, another
  machine) is given up, and the client is answered ``fallback``: it runs the
  in-process launcher, which waits in the claim. The claim ends when the
  client's ``store`` arrives, or when the client has died (checked by pid).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kernelcache._fs import pid_alive

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kernelcache.cache import Cache
    from kernelcache.singleflight import Claim

#: Seconds a caller waits for another's compile before it compiles itself
#: (``KERNELCACHE_NVCC_FLIGHT_TIMEOUT``); a long FlashInfer object takes minutes.
TIMEOUT = 600.0


def flight_key(direct: str) -> str:
    """The key a compile of the command of direct key ``direct`` is claimed under (never stored)."""
    from kernelcache.keys import KeyBuilder

    return KeyBuilder("kernelcache.nvcc.flight").add("direct", direct).hexdigest()


def timeout(env: Mapping[str, str]) -> float:
    """``KERNELCACHE_NVCC_FLIGHT_TIMEOUT`` seconds (default :data:`TIMEOUT`); ``ValueError`` if bad."""
    text = env.get("KERNELCACHE_NVCC_FLIGHT_TIMEOUT")
    if text is None:
        return TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"KERNELCACHE_NVCC_FLIGHT_TIMEOUT must be seconds >= 0, got {text!r}")
    return value


def claim(cache: Cache, direct: str, env: Mapping[str, str]) -> Claim:
    """Wait while another caller compiles the command of direct key ``direct``, then take
    the claim (the caller looks again)."""
    return cache.claim(flight_key(direct), timeout=timeout(env))


class Flying:
    """The claims a launcher server holds for the clients compiling now, by flight key."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Claim, int, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def take(self, cache: Cache, direct: str, pid: int) -> bool:
        """Claim the command of direct key ``direct`` for client ``pid`` without waiting;
        ``False``: someone compiles it now."""
        self.sweep()
        key = flight_key(direct)
        found = self._held.get(key)
        if found is not None:
            # Held for this very client already (it asked again): still its to compile.
            return found[1] == pid  # else another client of this server, alive
        held = cache.claim(key, timeout=0.0)
        if held.contended or held.entry is not None:
            held.abandon()
            return False
        # Held across requests of this one thread: not an open claim of the thread.
        self._held[key] = (held.hand_over(), pid, time.monotonic())
        return True

    def land(self, direct: str, pid: int) -> None:
        """The client ``pid`` stored (or failed) its compile of ``direct``: its waiters go on."""
        key = flight_key(direct)
        found = self._held.get(key)
        if found is not None and found[1] == pid:
            del self._held[key]
            found[0].abandon()

    def sweep(self, limit: float = TIMEOUT) -> None:
        """Give up the claims of clients that died, or that compile for longer than ``limit``."""
        now = time.monotonic()
        for key, (held, pid, since) in list(self._held.items()):
            if not pid_alive(pid) or now - since > limit:
                del self._held[key]
                held.abandon()

    def close(self) -> None:
        self.sweep(limit=-1.0)
