"""Small entries of the disk tier, packed: one append-only data file per shard and a mapped index.

A distinct-key hit of a file per entry pays an ``open`` and a ``close``; diskcache
reads an inline SQLite row through a mapping and was 1.3x faster on 4 KB entries
(issue 40, ``benchmarks/small_designs.py``: a pack with a mapped index measured
0.53x diskcache). So on a local filesystem an entry packed in at most
:data:`PACK_MAX` bytes lives in its shard's pack::

    v1/packs/<s>.idx          index: header + open-addressing slots, mapped MAP_SHARED
    v1/packs/<s>.<gen>.dat    records: packed entries (kernelcache.entry format), appended

A slot is ``(key hash, offset, length, flags, clock)`` (the index's format:
:mod:`.packindex`); the clock (ns) is the entry's last use, the LRU order's mtime. A hit is a probe of the mapping (no
system call) and one ``pread``; the record carries its key and checksums, and
is verified as an entry file is, so a torn or foreign record is a counted miss.

Writers hold the tier's space lock (``flock``: packs exist only on local
filesystems, where it and mapping coherence hold). A put appends its record at
the index's ``end``, then fills a free slot with the key hash written last; a
replaced or removed record's slot gets the tombstone hash. A writer killed
mid-append leaves bytes past ``end`` that the next append overwrites.

Removed records are dead bytes until compaction rewrites the live ones into
``<s>.<gen+1>.dat`` with a new index (grown if needed), sets the old index's
``retired`` flag and renames the new one over ``<s>.idx``: every process checks
that flag (one byte of the mapping) before using an index, and reopens. A
reader that still holds the old data file reads valid old records. The flag
goes first, so a compaction killed at any point leaves no process serving a
replaced index; one killed before its rename leaves the flag on the index in
place, which the next writer clears (a writer also retires an index it holds
that is no longer ``<s>.idx``, compared by inode under the lock).

Trust: the pack files must be regular files of this user (or root), writable
by no one else, as the tier's directories must; otherwise they are refused
(counted) and the shard's entries are files, as before packing.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import struct
import time
import weakref
from typing import TYPE_CHECKING, NamedTuple

from kernelcache import _fs
from kernelcache.entry_format import PREFIX_SIZE, unpack_from
from kernelcache.errors import CorruptEntry
from kernelcache.stores.base import EntryInfo
from kernelcache.stores.disk.layout import SHARDS, Found, UnsafeDirectory, shard_of, shards
from kernelcache.stores.disk.packindex import (
    HEADER_SIZE,
    MAX_SLOTS,
    ShardIndex,
    build_index,
    generation,
    key_hash,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kernelcache.stores.disk.layout import Layout

_FIRST_SLOTS = 64
#: An index is rebuilt (larger) when this fraction of its slots was ever used.
_MAX_LOAD = 0.6
#: Compaction runs when a shard's dead bytes exceed an eighth of its live ones and this
#: many bytes (each live byte is then copied about once per 8 bytes removed), or, on a
#: capped tier, its share of _CAP_SLACK of the cap. Dead bytes are outside the tier's
#: counter (an eviction frees what it removes at once), as are indexes (32 B a slot).
_DEAD_MIN = 1 << 14
#: How often (seconds) a hit checks that its shard's data file is still linked: packs
#: removed by hand (``rm -r``, the whole cache directory) stop being served within this.
RECHECK_SECONDS = 1.0
#: All packs' dead bytes together stay under this fraction of the cap: the margin that
#: eviction leaves below the cap (space.LOW_WATER), so the cap holds on disk.
_CAP_SLACK = 0.01
#: Where the key's length lies in an entry's prefix (entry_format._PREFIX: magic, 3 x u16).
_KEY_LEN_AT = 14
_OPEN_FILE = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
#: Attempts to open a shard whose index compactions replace while it is opened (each
#: failed one saw another compaction finish; a thread held off the GIL may see several).
_ATTACH_TRIES = 16
_SHARD_NAMES = shards()


#: Every Packs of this process: a forked child forgets their open shards (it shares the
#: parent's descriptors and mappings; it opens its own), without a getpid() per hit.
_ALL: weakref.WeakSet[Packs] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for packs in list(_ALL):
        packs._shards = {}  # noqa: SLF001 (this module's own class)


os.register_at_fork(after_in_child=_forget_after_fork)


def file_problem(st: os.stat_result) -> str | None:
    """Why a pack file with status ``st`` must not be trusted (the rule of the tier's folders)."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class DamagedRecord(CorruptEntry):
    """A packed record that failed verification; ``offset`` is where it was read, which
    alone is removed (a newer record of the key published since must stay)."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


class Record(NamedTuple):
    """A live packed entry as a listing sees it."""

    key: str
    offset: int
    length: int
    clock_ns: int


class Packs:
    """The packs of one disk tier (see the module docstring).

    ``refused`` is called for each pack file refused by the trust rule. A
    read-only tier maps indexes read-only and never writes a clock.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        read_only: bool,
        durable: bool = False,
        max_bytes: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.layout = layout
        self.folder = f"{layout.base}/packs"
        self.read_only = read_only
        self.durable = durable
        self._max_bytes = max_bytes
        self._shards: dict[str, ShardIndex | None] = {}
        #: ``[bytes, records]`` that compactions dropped as damaged since the space took
        #: them (:meth:`take_dropped`): counted entries that are gone.
        self._dropped = [0, 0]
        _ALL.add(self)

    # Opening -------------------------------------------------------------
    def _dir_ok(self, create: bool) -> bool:
        """Whether the packs' folder is there and safe (made, or a link or a file there
        replaced, when ``create``). A refused one (counted) means no pack: files serve."""
        try:
            return self.layout.directory(self.folder, create=create)
        except (OSError, UnsafeDirectory):
            return False

    def shard(self, name: str, create: bool = False, hit: bool = False) -> ShardIndex | None:
        """The open pack of shard ``name`` (reopened if it was retired), or ``None``.
        ``hit``: a get's lookup, which may trust a shard known to have no pack."""
        s = self._shards.get(name)
        if s is not None and not s.retired and not (hit and self._removed(s)):
            return s
        if s is None and name in self._shards and hit:
            # Known absent (or refused): a hit of a file must not pay a lookup for a pack
            # each time; its miss looks again (stale). Anything else (writers, listings,
            # removals) looks now: another process may have made the pack since.
            return None
        if s is not None:
            # Not closed here: another thread may be reading it (a closed fd's number
            # reused would read another file). Closed when the last user lets it go.
            # Popped, not deleted: another thread that saw it retired may have taken it.
            self._shards.pop(name, None)
        s = self._attach(name)
        if s is None and create:
            self._create(name)
            s = self._attach(name)
        self._shards[name] = s
        return s

    @staticmethod
    def _removed(s: ShardIndex) -> bool:
        """Whether ``s``'s data file was unlinked by hand (no compaction retired it), asked
        at most every :data:`RECHECK_SECONDS`: an ``fstat``, not one per hit. A pack
        removed so must not be served, least of all once another version is put."""
        now = time.monotonic()
        if now < s.check_at:
            return False
        s.check_at = now + RECHECK_SECONDS
        try:
            return os.fstat(s.data).st_nlink == 0
        except OSError:
            return True

    def locked_shard(self, name: str, create: bool = False) -> ShardIndex | None:
        """:meth:`shard` for a writer (under the space lock): the index at ``<name>.idx``
        now. One this process holds that is no longer there (replaced by a compaction
        killed before it retired it) is retired first, so that no process serves or
        compacts it again; a retired flag on the index that is there (a compaction killed
        before its rename) is cleared."""
        s = self._shards.get(name)
        if s is not None and not s.retired:
            try:
                ino = os.stat(f"{self.folder}/{name}.idx", follow_symlinks=False).st_ino
            except OSError:
                ino = -1
            if ino != s.ino:
                if s.writable:
                    s.retire()
                self._shards.pop(name, None)  # a reader thread may have taken it (shard)
        held = self._shards.get(name)
        s = self.shard(name, create)
        if s is not None and s.writable and s is not held:
            if s.retired:
                s.retire(False)
            # Opened by this process's first change of the shard: data files of other
            # generations that a killed compaction left go now (uncounted bytes).
            self._sweep(name, s.header()[2])
        return s

    def _sweep(self, name: str, gen: int) -> None:
        """Remove shard ``name``'s data files other than generation ``gen``'s (under the
        space lock: no compaction is writing one)."""
        for item in os.listdir(self.folder):
            stem, _, rest = item.partition(".")
            if stem == name and rest.endswith(".dat") and rest != f"{gen}.dat":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self.folder}/{item}")

    def stale(self, name: str) -> bool:
        """Whether shard ``name``'s index file is not the one this process has open
        (made by another process since, or replaced by a compaction that died before
        retiring the old one). A ``stat``: run on misses only."""
        s = self._shards.get(name)
        try:
            st = os.stat(f"{self.folder}/{name}.idx", follow_symlinks=False)
        except OSError:
            return False
        if s is not None and st.st_ino == s.ino:
            return False
        self._shards.pop(name, None)  # looked up afresh by the next shard()
        return True

    def _attach(self, name: str, tries: int = _ATTACH_TRIES) -> ShardIndex | None:
        """Open shard ``name``'s index and data file; ``tries``: attempts left when a
        compaction replaces the index between the two opens."""
        if not self._dir_ok(create=False):
            return None
        writable = not self.read_only
        path = f"{self.folder}/{name}.idx"
        try:
            try:
                fd = os.open(
                    path, _OPEN_FILE & ~os.O_RDONLY | os.O_RDWR if writable else _OPEN_FILE
                )
            except (PermissionError, OSError) as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                # A read-only mount, or a cache of root's that users read: read it as it is.
                writable = False
                fd = os.open(path, _OPEN_FILE)
        except FileNotFoundError:
            return None
        except OSError:
            self.layout.refused()  # a link (ELOOP) or unreadable
            return None
        try:
            st = os.fstat(fd)
            if file_problem(st) is not None or st.st_size < HEADER_SIZE:
                self.layout.refused()
                return None
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            mm = mmap.mmap(fd, st.st_size, access=access)
        finally:
            os.close(fd)
        gen = generation(mm)
        if gen is None:
            mm.close()
            self.layout.refused()  # not an index of this format: damaged or foreign
            return None
        try:
            flags = _OPEN_FILE if not writable else _OPEN_FILE & ~os.O_RDONLY | os.O_RDWR
            data = os.open(f"{self.folder}/{name}.{gen}.dat", flags)
        except OSError as exc:
            # Compared while still mapped: the old index's inode number cannot be reused.
            again = isinstance(exc, FileNotFoundError) and tries > 1 and self._replaced(name, st)
            mm.close()
            if again:
                # A compaction swept this generation after renaming a new index in (its
                # old data file goes last): the new one holds every entry. Not a miss.
                return self._attach(name, tries - 1)
            return None
        if file_problem(os.fstat(data)) is not None:
            os.close(data)
            mm.close()
            self.layout.refused()
            return None
        return ShardIndex(name, mm, data, st.st_ino, writable)

    def _replaced(self, name: str, st: os.stat_result) -> bool:
        """Whether shard ``name``'s index is no longer the file of status ``st``."""
        try:
            now = os.stat(f"{self.folder}/{name}.idx", follow_symlinks=False)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)

    def _create(self, name: str, slots: int = _FIRST_SLOTS) -> None:
        """Make an empty pack for shard ``name`` (under the space lock), unless the packs'
        folder is refused."""
        if self._dir_ok(create=True):
            self._write(name, 1, [], slots)

    def drop_empty(self) -> None:
        """Remove the packs that hold no live record (``clear``; under the space lock)."""
        for name in _SHARD_NAMES:
            s = self.locked_shard(name)
            if s is None or s.header()[5] != 0:
                continue
            s.retire()
            for path in (f"{self.folder}/{name}.idx", f"{self.folder}/{name}.{s.header()[2]}.dat"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._shards[name] = None

    def _write(
        self, name: str, gen: int, records: list[tuple[int, bytes, int]], slots: int
    ) -> None:
        """Write data file ``gen`` holding ``records`` (hash, bytes, clock) and an index over
        it, renamed over the shard's index (under the space lock)."""
        data_path = f"{self.folder}/{name}.{gen}.dat"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(data_path)  # left by a compaction that died
        _fs.write_new(data_path, [r[1] for r in records], durable=self.durable)
        _fs.write_atomic(
            f"{self.folder}/{name}.idx",
            build_index([(h, len(raw), clock) for h, raw, clock in records], slots, gen),
            staging=self.layout.staging,
            durable=self.durable,
        )

    # Reads ---------------------------------------------------------------
    def read(
        self, key: str, shard: str, touch_after: float
    ) -> tuple[str, bytes, dict[str, bytes], int] | None:
        """``(key, meta_raw, artifacts, size)`` of ``key``'s verified record, or ``None``
        (not packed). :class:`DamagedRecord` if the record fails verification. A hit
        moves the entry up the LRU order if it was last used over ``touch_after``
        seconds ago (rate-limited like a file's mtime: most hits write nothing)."""
        s = self.shard(shard, hit=True)
        if s is None:
            return None
        h = key_hash(key)
        i = s.find(h)
        if i < 0:
            return None
        found, offset, length, _flags, clock = s.slot(i)
        if found != h:
            return None  # removed since the probe, and the slot taken by another key's put
        raw = os.pread(s.data, length, offset)
        try:
            recorded, meta_raw, artifacts = unpack_from(raw, length, key)
        except CorruptEntry as exc:
            raise DamagedRecord(str(exc), offset) from exc
        if s.writable:
            now = time.time_ns()
            if now - clock > touch_after * 1e9:
                s.touch(i, now)
        return recorded, meta_raw, artifacts, length

    def _find(self, key: str, shard: str, locked: bool = False) -> tuple[ShardIndex, int] | None:
        """``key``'s shard index and slot, or ``None`` (not packed). ``locked``: a writer's,
        under the space lock (:meth:`locked_shard`). A get inlines this (:meth:`read`)."""
        s = self.locked_shard(shard) if locked else self.shard(shard)
        if s is None:
            return None
        i = s.find(key_hash(key))
        return None if i < 0 else (s, i)

    def where(self, key: str, shard: str) -> tuple[int, int] | None:
        """``(offset, length)`` of ``key``'s record, or ``None``."""
        found = self._find(key, shard)
        return None if found is None else found[0].slot(found[1])[1:3]

    def raw(self, key: str, shard: str, offset: int, clock: int | None = None) -> bytes | None:
        """The bytes of ``key``'s record if it is still the one at ``offset``, or the one
        last used at ``clock`` (moved by a compaction since it was listed; verify)."""
        found = self._find(key, shard)
        if found is None:
            return None
        s, i = found
        _h, at, length, _flags, used = s.slot(i)
        if at != offset and (clock is None or used != clock):
            return None
        return os.pread(s.data, length, at)

    def records(self, shard: str) -> list[Record]:
        """The live records of ``shard`` with their keys (read from the records: a record
        whose key cannot be read is listed under no key, and dropped by compaction)."""
        s = self.shard(shard)
        if s is None:
            return []
        found = []
        for _i, h, offset, length, clock in s.live():
            key = _record_key(s.data, offset, length)
            if key is not None and key_hash(key) == h:
                found.append(Record(key, offset, length, clock))
        return found

    def _dead_limit(self, live: int) -> int:
        """How many dead bytes a shard whose records hold ``live`` bytes may keep."""
        limit = max(live // 8, _DEAD_MIN)
        cap = self._max_bytes()
        return limit if cap is None else min(limit, int(cap * _CAP_SLACK / SHARDS))

    def found(self, shard: str) -> list[Found]:
        """:meth:`records` as a scan of the shard lists them."""
        return [
            Found(r.key, None, record=r.offset, length=r.length, clock_ns=r.clock_ns)
            for r in self.records(shard)
        ]

    # Changes (the caller holds the space lock) ---------------------------
    def append(self, key: str, shard: str, parts: Sequence[bytes], size: int) -> int:
        """Publish ``key``'s packed entry; returns the bytes of the record it replaced
        (-1 if none). The caller counts, then compacts (:meth:`tidy`)."""
        s = self.locked_shard(shard, create=True)
        if s is None:
            raise OSError(f"the pack of shard {shard} is refused")
        _retired, slots, gen, end, used, live, dead = s.header()
        h = key_hash(key)
        if end > os.fstat(s.data).st_size:
            # A damaged header (appends would go where no write reaches): rebuilt from the
            # records that are whole.
            self.layout.refused()
            s = self._compact(s, grow=False)
            _retired, slots, gen, end, used, live, dead = s.header()
        if (used + 1) > slots * _MAX_LOAD or s.free(h) < 0:
            s = self._compact(s, grow=True)
            _retired, slots, gen, end, used, live, dead = s.header()
        old = s.find(h)
        written = os.pwritev(s.data, parts, end)
        if self.durable:
            # The record is on disk before its slot can be (the guarantee a file's fsync
            # before its rename gives): after a power loss the entry is whole or absent.
            os.fsync(s.data)
        if written != size:
            raise OSError(f"short write to the pack of shard {shard}")
        replaced = -1
        if old >= 0:
            replaced = s.slot(old)[2]
            live, dead = live - replaced, dead + replaced
        # The header first: a writer killed before the slot leaves dead bytes (live counts
        # them until a compaction recounts), never a slot past ``end`` that the next
        # append overwrites.
        s.set_header((0, slots, gen, end + size, used + 1, live + size, dead))
        s.insert(s.free(h), h, end, size, time.time_ns())
        if old >= 0:
            s.kill(old)
        return replaced

    def remove(
        self,
        key: str,
        shard: str,
        expect_offset: int | None = None,
        expect_clock: int | None = None,
        *,
        damaged: bool = False,
    ) -> int:
        """Drop ``key``'s record (if it is still at ``expect_offset``, and last used at
        ``expect_clock``: a listing's name for it, which compaction keeps); its bytes, or -1.
        ``damaged``: only if the record fails verification now, under the lock. A hit that
        found it damaged may have read its slot torn (a weakly ordered CPU shows a slot's
        hash before its offset and length); the record itself is then whole and stays."""
        found = self._find(key, shard, locked=True)
        if found is None:
            return -1
        s, i = found
        h, offset, length, _flags, clock = s.slot(i)
        if expect_offset is not None and offset != expect_offset:
            return -1
        if expect_clock is not None and clock != expect_clock:
            return -1  # replaced or used since it was listed
        if damaged:
            raw = os.pread(s.data, length, offset)
            if len(raw) == length and _verified(raw, h):
                return -1
        s.kill(i)
        _retired, slots, gen, end, used, live, dead = s.header()
        s.set_header((0, slots, gen, end, used, live - length, dead + length))
        return length

    def evict(self, key: str, shard: str, clock_ns: int) -> int:
        """Drop ``key``'s record if it was not used since ``clock_ns``; its bytes, or -1."""
        found = self._find(key, shard, locked=True)
        if found is None:
            return -1
        _h, offset, _length, _flags, clock = found[0].slot(found[1])
        if clock != clock_ns:
            return -1  # used or replaced since the scan
        return self.remove(key, shard, offset)

    def used(self, key: str, shard: str) -> bool:
        """Whether ``key`` is packed; marks it used now (an extraction's entry stays)."""
        found = self._find(key, shard, locked=True)
        if found is None:
            return False
        s, i = found
        if s.writable:
            s.touch(i, time.time_ns())
        return True

    def take_dropped(self) -> tuple[int, int]:
        """``(bytes, records)`` dropped as damaged by compactions since the last call."""
        dropped, self._dropped = self._dropped, [0, 0]
        return dropped[0], dropped[1]

    def tidy(self, shard: str) -> None:
        """Compact ``shard`` if its dead bytes are over their limit (under the space lock;
        after the caller counted its change: a failure here loses nothing)."""
        s = self.locked_shard(shard)
        if s is None:
            return
        _retired, _slots, _gen, _end, _used, live, dead = s.header()
        if dead > self._dead_limit(live):
            self._compact(s, grow=False)

    def _compact(self, s: ShardIndex, grow: bool) -> ShardIndex:
        """Rewrite ``s``'s live records into a new generation; the old index is retired."""
        kept = []
        for _i, h, offset, length, clock in s.live():
            raw = os.pread(s.data, length, offset)
            if len(raw) == length and _verified(raw, h):  # damage is dropped, not copied on
                kept.append((h, raw, clock))
            else:
                self._dropped[0] += length
                self._dropped[1] += 1
        slots = s.slots
        while len(kept) + 1 > slots * _MAX_LOAD / 2 and grow and slots < MAX_SLOTS:
            slots *= 2
        gen = s.header()[2]
        # Retired before the rename: a process that reopens meanwhile finds the old index
        # (valid) and reopens again. A kill before the rename leaves the flag on the index
        # in place (the next writer clears it); after it, no process keeps the old one.
        s.retire()
        try:
            self._write(s.name, gen + 1, kept, slots)
        except BaseException:
            s.retire(False)
            raise
        self._sweep(s.name, gen + 1)  # this generation's, and any a crash left
        fresh = self.shard(s.name)
        if fresh is None:
            raise OSError(f"the pack of shard {s.name} vanished during compaction")
        return fresh

    def close(self) -> None:
        for s in list(self._shards.values()):
            if s is not None:
                s.close()
        self._shards.clear()


def _record_key(fd: int, offset: int, length: int) -> str | None:
    """The key a record at ``offset`` says it holds, or ``None`` if it has none. Its header
    is not checked (the caller matches the key to the slot's hash; verify reports the
    rest), so a record damaged elsewhere is still listed by its key, as a damaged file is
    by its name."""
    head = os.pread(fd, min(length, PREFIX_SIZE + 256), offset)
    if len(head) < PREFIX_SIZE:
        return None
    key_len = struct.unpack_from("<H", head, _KEY_LEN_AT)[0]
    raw = head[PREFIX_SIZE : PREFIX_SIZE + key_len]
    try:
        return raw.decode("ascii") if len(raw) == key_len else None
    except UnicodeDecodeError:
        return None


def _verified(raw: bytes, h: int) -> bool:
    """Whether ``raw`` is a whole record whose key hashes to ``h`` (what compaction keeps)."""
    if len(raw) < PREFIX_SIZE:
        return False
    key_len = struct.unpack_from("<H", raw, _KEY_LEN_AT)[0]
    try:
        key = raw[PREFIX_SIZE : PREFIX_SIZE + key_len].decode("ascii")
    except UnicodeDecodeError:
        return False
    if key_hash(key) != h:
        return False
    try:
        unpack_from(raw, len(raw), key)
    except CorruptEntry:
        return False
    return True


def info_of_packed(f: Found, packs: Packs | None) -> EntryInfo:
    """What listings say of a packed entry: its record's bytes plus its extracted copies (as
    the cap counts them); ``extra`` says where the record is (``record``: its offset) and its
    last use (``clock_ns``: what names it to a removal, kept by compaction)."""
    folder = packs.folder if packs is not None else ""
    extra = {
        "ino": 0,
        "packed": True,
        "record": f.record,
        "clock_ns": f.clock_ns,
        "path": f"{folder}/{shard_of(f.key)}.idx",
        "extracted": f.extracted,
    }
    clock = f.clock_ns / 1e9
    return EntryInfo(f.key, f.size, clock, clock, extra)
