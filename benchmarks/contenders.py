"""The stores and peers that bench_stores.py measures, behind one tiny adapter shape.

Every adapter is opened on a fresh directory, told the value of the current
size with :meth:`Contender.prepare` (outside the timed region: a compiler
hands the user an ``ObjectCode`` / the user builds an ``Entry`` once), and
then timed on ``get(key)`` -> the artifact's bytes, and ``put(key)``.
A peer that is not installed is reported as ``n/a``, never faked.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, ClassVar

# What a crash leaves behind, per put. "atomic" = readers (and a process
# killed mid-put) see the old value or the new one, never a partial one;
# "+fsync" = the data is also flushed before it is published.
ATOMIC = "atomic"
ATOMIC_FSYNC = "atomic+fsync"


class Unavailable(Exception):
    """The contender cannot run here (not installed, or not written yet)."""


class Contender:
    name: ClassVar[str]
    #: Crash guarantee of put (ATOMIC, ATOMIC_FSYNC or "" when not persistent).
    guarantee: ClassVar[str] = ATOMIC
    #: What a get checks before handing the bytes over.
    verified: ClassVar[str] = "unchecked"
    #: A peer (not kernelcache, not the raw-file limit): counts for "fastest peer".
    peer: ClassVar[bool] = False
    #: Which operations it takes part in.
    ops: ClassVar[tuple[str, ...]] = ("get", "put")

    def open(self, path: str) -> None:
        raise NotImplementedError

    def prepare(self, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def put(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the backend; the directory is removed by the caller."""


class RawRead(Contender):
    """The limit for a read: ``open(path, 'rb').read()`` of a file holding just the bytes."""

    name = "raw file (open().read() / tmp+rename)"

    def open(self, path: str) -> None:
        self.dir = path
        self.tmp = os.path.join(path, "tmp")
        os.makedirs(self.tmp)
        self.n = 0

    def prepare(self, value: bytes) -> None:
        self.value = value

    def get(self, key: str) -> bytes:
        with open(f"{self.dir}/{key}", "rb") as f:
            return f.read()

    def put(self, key: str) -> None:
        # The limit for an atomic put: write a private file, rename it over the target.
        self.n += 1
        tmp = f"{self.tmp}/{self.n}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.value)
        finally:
            os.close(fd)
        os.replace(tmp, f"{self.dir}/{key}")


class RawOs(RawRead):
    """The floor below the idiom: ``os.open`` + ``os.read`` of the known size, no file object."""

    name = "raw file (os.read)"
    ops = ("get",)

    def get(self, key: str) -> bytes:
        fd = os.open(f"{self.dir}/{key}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)


class RawVerified(RawRead):
    """The floor of a verified read: ``open().read()`` then one xxh3-128 pass over the bytes.

    What no verifying cache can beat: the raw read plus the one hash pass that
    checks the bytes. Not a peer; shown so the cost of verification is visible
    next to the unchecked peers.
    """

    name = "raw file + xxh3-128 (verified floor)"
    verified = "xxh3-128"
    ops = ("get",)

    def open(self, path: str) -> None:
        import xxhash

        super().open(path)
        self._hash = xxhash.xxh3_128_digest
        self._digests: dict[str, bytes] = {}

    def get(self, key: str) -> bytes:
        data = super().get(key)
        expected = self._digests.get(key)
        if expected is None:
            expected = self._digests[key] = self._hash(data)
        if self._hash(data) != expected:
            raise ValueError(f"{key}: the bytes changed")
        return data


class RawFsync(RawRead):
    """Reference for durable puts: tmp, write, fsync, rename."""

    name = "raw file (tmp+fsync+rename)"
    guarantee = ATOMIC_FSYNC
    ops = ("put",)

    def put(self, key: str) -> None:
        self.n += 1
        tmp = f"{self.tmp}/{self.n}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.value)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, f"{self.dir}/{key}")


class _KernelcacheStore(Contender):
    """A kernelcache tier: ``store.get(key)["data"]`` and ``store.put(key, entry)``."""

    verified = "xxh3-128"

    def _make(self, path: str) -> Any:
        raise NotImplementedError

    def open(self, path: str) -> None:
        self.store = self._make(path)

    def prepare(self, value: bytes) -> None:
        from kernelcache import Entry

        self.entry = Entry({"data": value})

    def get(self, key: str) -> bytes:
        data: bytes = self.store.get(key)["data"]
        return data

    def put(self, key: str) -> None:
        self.store.put(key, self.entry)

    def close(self) -> None:
        self.store.close()


class Memory(_KernelcacheStore):
    name = "kernelcache MemoryStore"
    guarantee = ""
    verified = "in-process object"

    def _make(self, path: str) -> Any:
        from kernelcache import MemoryStore

        return MemoryStore()


class Disk(_KernelcacheStore):
    name = "kernelcache DiskStore"

    def _make(self, path: str) -> Any:
        from kernelcache import DiskStore

        return DiskStore(path)


class DiskDurable(_KernelcacheStore):
    name = "kernelcache DiskStore(durable=True)"
    guarantee = ATOMIC_FSYNC
    ops = ("put",)

    def _make(self, path: str) -> Any:
        from kernelcache import DiskStore

        return DiskStore(path, durable=True)


class SQLite(_KernelcacheStore):
    name = "kernelcache SQLiteStore"

    def _make(self, path: str) -> Any:
        try:
            from kernelcache.stores.sqlite import SQLiteStore
        except ImportError as exc:
            raise Unavailable(f"kernelcache.stores.sqlite not importable: {exc}") from exc
        os.makedirs(path)
        return SQLiteStore(os.path.join(path, "cache.sqlite"))


class DiskCache(Contender):
    """``diskcache.Cache``: SQLite rows, values >= 32 KB in files written before the row commits.

    Readers never see a partial value (the row that points to a file commits
    after the file is written); nothing is fsync'ed by default, so it offers
    the same crash guarantee as DiskStore.put.
    """

    name = "diskcache.Cache"
    peer = True

    def open(self, path: str) -> None:
        try:
            import diskcache
        except ImportError as exc:
            raise Unavailable(f"diskcache not installed: {exc}") from exc
        self.cache = diskcache.Cache(path)

    def prepare(self, value: bytes) -> None:
        self.value = value

    def get(self, key: str) -> bytes:
        data: bytes = self.cache.get(key)
        return data

    def put(self, key: str) -> None:
        self.cache.set(key, self.value)

    def close(self) -> None:
        self.cache.close()


class FileStream(Contender):
    """cuda.core ``FileStreamProgramCache``: mkstemp, write, fsync, ``os.replace``.

    Every read also re-opens the file to bump its atime (its LRU clock).
    """

    name = "cuda.core FileStreamProgramCache"
    guarantee = ATOMIC_FSYNC
    peer = True

    def open(self, path: str) -> None:
        try:
            from cuda.core.utils import FileStreamProgramCache
        except ImportError as exc:
            raise Unavailable(f"cuda.core not installed: {exc}") from exc
        self.cache = FileStreamProgramCache(path)

    def prepare(self, value: bytes) -> None:
        from cuda.core import ObjectCode

        self.value = ObjectCode.from_cubin(value)

    def get(self, key: str) -> bytes:
        data: bytes = self.cache.get(key)
        return data

    def put(self, key: str) -> None:
        self.cache[key] = self.value

    def close(self) -> None:
        self.cache.close()


class TritonFiles(Contender):
    """Triton's ``FileCacheManager``: a directory per key, a file per artifact.

    A put writes the file in a temporary directory and renames it into place
    (atomic, no fsync); a hit is ``get_file`` (an existence check) and reading
    the file, as Triton loads a kernel. One manager per key, made by the put
    and kept: Triton makes one per compile, which would add a ``makedirs``.
    """

    name = "Triton FileCacheManager"
    peer = True

    def open(self, path: str) -> None:
        try:
            from triton.runtime.cache import FileCacheManager
        except ImportError as exc:
            raise Unavailable(f"triton not installed: {exc}") from exc
        os.makedirs(path)
        self._saved = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = path  # read by each manager it makes
        self._cls = FileCacheManager
        self.managers: dict[str, Any] = {}

    def prepare(self, value: bytes) -> None:
        self.value = value

    def get(self, key: str) -> bytes:
        path = self.managers[key].get_file("kernel.cubin")
        with open(path, "rb") as f:
            data: bytes = f.read()
        return data

    def put(self, key: str) -> None:
        manager = self.managers[key] = self._cls(key)
        manager.put(self.value, "kernel.cubin")

    def close(self) -> None:
        if self._saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = self._saved


#: In table order.
ALL: tuple[type[Contender], ...] = (
    RawRead,
    RawVerified,
    RawOs,
    RawFsync,
    Memory,
    Disk,
    DiskDurable,
    SQLite,
    DiskCache,
    FileStream,
    TritonFiles,
)


def open_all(root: str, tag: str) -> tuple[list[Contender], dict[str, str]]:
    """Open every contender on its own fresh directory; returns (opened, unavailable -> why)."""
    opened: list[Contender] = []
    missing: dict[str, str] = {}
    for cls in ALL:
        contender = cls()
        path = os.path.join(root, f"{tag}-{cls.__name__}")
        shutil.rmtree(path, ignore_errors=True)
        try:
            contender.open(path)
        except Unavailable as exc:
            missing[cls.name] = str(exc)
            continue
        opened.append(contender)
    return opened, missing
