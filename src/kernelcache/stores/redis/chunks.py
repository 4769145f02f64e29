"""Large entries: chunks written under a fresh write id, published by one Lua script.

Chunks are written with a staging expiry; then :data:`PUBLISH_LUA` checks
they are all there, swaps the manifest in, makes the chunks permanent (or
gives them the TTL) and lets the replaced chunks expire after a grace period,
so a reader still fetching them finishes undisturbed. A writer that dies
before the swap leaves chunks that expire by themselves. Every call moves at
most :data:`CALL_BYTES` of chunks, so each fits in the timeout plus its
transfer allowance (see ``guard.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from kernelcache.errors import CorruptEntry, StoreError
from kernelcache.stores.redis.format import MAX_CHUNK_SIZE, Manifest
from kernelcache.stores.redis.guard import Guard

#: Chunk bytes one pipelined call reads or writes at most.
CALL_BYTES = MAX_CHUNK_SIZE
#: RESP framing of one reply (``$<length>\r\n`` ... ``\r\n``), at most.
REPLY_FRAMING = 64

# The one writer of records, run atomically by Redis. It reads the trailer of
# the value it replaces (format.py: ... flags, version, b"KCR" at the end) and,
# when that was a manifest (its body starts "<write id>:<count>:"), lets the
# old chunks expire. KEYS[1] record key. ARGV: 1 new record ('' deletes), 2 TTL
# ms (0: none), 3 chunk name base, 4 new write id ('' if inline), 5 new chunk
# count, 6 grace ms, 7 SHA-1 the current value's last 256 bytes must have ('' for
# any: see listing.fingerprint), 8 the most old chunks to expire (a forged manifest must not make Redis loop long).
# The chunk names share the record's hash tag: one slot, so this works in a
# cluster. ARGV 9: '1' keeps a signed record (format.py's SIGNED flag in its
# trailer) in place: the write is refused, -2, and the writer decides whether it
# may replace it (it verified it: see store.py). Returns -1 if a new chunk is
# missing (its staging expiry passed), else 0/1 whether a record existed before.
PUBLISH_LUA = """
local base, wid, n = ARGV[3], ARGV[4], tonumber(ARGV[5])
if ARGV[7] ~= '' then
  local cur = redis.pcall('GETRANGE', KEYS[1], -256, -1)
  if type(cur) ~= 'string' or redis.sha1hex(cur) ~= ARGV[7] then return 0 end
end
if ARGV[9] == '1' then
  local t = redis.pcall('GETRANGE', KEYS[1], -13, -1)
  if type(t) == 'string' and #t == 13 and string.sub(t, 11) == 'KCR'
      and string.byte(t, 10) == 2 and math.floor(string.byte(t, 9) / 4) % 2 == 1 then
    return -2
  end
end
for i = 0, n - 1 do
  if redis.call('EXISTS', base .. wid .. ':' .. i) == 0 then return -1 end
end
local owid, on
local tail = redis.pcall('GETRANGE', KEYS[1], -13, -1)
if type(tail) == 'string' and #tail == 13 and string.sub(tail, 11) == 'KCR'
    and string.byte(tail, 10) == 2 and string.byte(tail, 9) % 4 >= 2 then
  owid, on = string.match(redis.call('GETRANGE', KEYS[1], 0, 127), '^(%x+):(%d+):')
end
local existed = redis.call('EXISTS', KEYS[1])
local ttl = tonumber(ARGV[2])
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
elseif ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
for i = 0, n - 1 do
  if ttl > 0 then redis.call('PEXPIRE', base .. wid .. ':' .. i, ttl)
  else redis.call('PERSIST', base .. wid .. ':' .. i) end
end
if owid and owid ~= wid and tonumber(on) <= tonumber(ARGV[8]) then
  for i = 0, tonumber(on) - 1 do redis.call('PEXPIRE', base .. owid .. ':' .. i, ARGV[6]) end
end
return existed
"""

# A value longer than any record (ARGV[1] bytes) at KEYS[1] is not ours: drop it
# without reading it. UNLINK frees it off Redis's main thread.
DROP_LONGER_LUA = """
local n = redis.pcall('STRLEN', KEYS[1])
if type(n) == 'number' and n > tonumber(ARGV[1]) then return redis.call('UNLINK', KEYS[1]) end
return 0
"""


def read(
    guard: Guard, base: str, manifest: Manifest, command: Callable[[str], tuple[Any, ...]]
) -> list[bytes] | None:
    """The chunks of ``manifest`` (names ``base + i``), or ``None`` if one is missing.

    Stops at the first call that finds a chunk missing: a forged manifest
    costs one call, not one per chunk it claims.
    """
    per_call = max(1, CALL_BYTES // manifest.chunk_size)
    parts: list[bytes] = []
    for first in range(0, manifest.chunks, per_call):
        names = [f"{base}{i}" for i in range(first, min(first + per_call, manifest.chunks))]
        expected = len(names) * manifest.chunk_size
        replies = guard.pipeline(
            _queue(names, command),
            key=names[0],
            limit=expected + REPLY_FRAMING * len(names),
            moving=expected,
        )
        if any(reply is None for reply in replies):
            return None
        for reply in replies:
            if not isinstance(reply, bytes) or len(reply) > manifest.chunk_size:
                raise CorruptEntry("a chunk is not a string of at most the chunk size")
        parts.extend(replies)
    return parts


def write(guard: Guard, base: str, payload: bytes, chunk_size: int, staging_ms: int) -> int:
    """Write ``payload`` as chunks ``base + i`` that expire unless published; their count."""
    view = memoryview(payload)
    chunks = [view[start : start + chunk_size] for start in range(0, len(payload), chunk_size)]
    per_call = max(1, CALL_BYTES // chunk_size)
    for first in range(0, len(chunks), per_call):
        batch = {f"{base}{i}": chunks[i] for i in range(first, min(first + per_call, len(chunks)))}
        moving = sum(map(len, batch.values()))
        guard.pipeline(_queue_sets(batch, staging_ms), key=next(iter(batch)), moving=moving)
    return len(chunks)


def drop(guard: Guard, base: str, count: int) -> None:
    """Remove staged chunks ``base + i`` that will not be published (best effort: they
    expire anyway)."""
    names = [f"{base}{i}" for i in range(count)]
    for first in range(0, len(names), 512):
        batch = names[first : first + 512]
        with contextlib.suppress(StoreError):  # counted by the guard
            guard.pipeline(_queue_unlinks(batch), key=batch[0])


def _queue(names: list[str], command: Callable[[str], tuple[Any, ...]]) -> Callable[[Any], None]:
    def build(pipe: Any) -> None:
        for name in names:
            pipe.execute_command(*command(name))

    return build


def _queue_unlinks(names: list[str]) -> Callable[[Any], None]:
    def build(pipe: Any) -> None:
        for name in names:
            pipe.unlink(name)

    return build


def _queue_sets(batch: dict[str, memoryview], staging_ms: int) -> Callable[[Any], None]:
    def build(pipe: Any) -> None:
        for name, chunk in batch.items():
            pipe.set(name, chunk, px=staging_ms)

    return build
