"""Two "nodes" of a network filesystem, for the tests and benchmarks/bench_netfs.py.

:class:`NetFS` mounts ``tests/netfs/netfs.c`` (a fault-injecting passthrough
filesystem on libfuse3's low-level API) twice over one backing directory:
``fs.nodes[0].path`` and ``fs.nodes[1].path`` see the same files, as two NFS
clients of one server do, while each mount injects its own faults
(:class:`Faults`) and counts its own requests (round trips). The binary is
compiled once per source version with ``cc`` and cached under
``~/.cache/kernelcache-tests``.

Faults a mount can inject (see netfs.c):

- ``latency_us`` before every answer (a network round trip);
- ``stale_unlinked``: ``ESTALE`` on an inode that the other mount removed or
  renamed a file over, as an NFSv3 client gets for a freed file handle;
- ``ebusy_open``: ``EBUSY`` on rename, unlink or rmdir of a file or directory
  open on either mount (GPFS);
- ``attr_timeout_ms``: the kernel trusts attributes, names and absent names for
  that long, so this mount lags what the other one changed (NFS ``actimeo``);
- random ``ESTALE``/``EIO``/``EBUSY`` at a rate per million requests of the kinds named;
- flock (``flock=`` of :class:`NetFS`): ``"local"`` (the kernel's, per mount:
  locks never conflict across the nodes), ``"none"`` (``ENOLCK``, Lustre without
  ``-o flock``) or ``"shared"`` (taken on the backing file: locks that span nodes).

Needs ``/dev/fuse``, root (or fusermount3), ``cc`` and libfuse3's headers
(Debian: ``fuse3 libfuse3-dev``; scripts/test.sh installs them when missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import mmap
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

SOURCE = Path(__file__).resolve().parent / "netfs" / "netfs.c"
SKIP_REASON = (
    "FUSE unavailable: {}. Install fuse3 and libfuse3-dev (scripts/test.sh does it when missing)"
)

#: Request kinds, in the order of netfs.c's counters (and the bits of the fault masks).
OPS = (
    "lookup", "getattr", "setattr", "readlink", "mkdir", "unlink", "rmdir", "symlink",
    "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir",
    "readdir", "releasedir", "statfs", "create", "flock", "forget", "mknod",
)  # fmt: skip
#: Requests that are not a round trip on NFS (no reply is awaited, or the client handles them).
NOT_ROUND_TRIPS = frozenset({"forget", "release", "releasedir", "flush"})
INJECTED = ("estale", "estale_unlinked", "eio", "ebusy")

_MAGIC = 0x3173666574656E
_SETTINGS = struct.Struct("<Q8i3Q")  # magic, 8 int32 settings, 3 masks
_OPS_AT = _SETTINGS.size + 4 * 8  # after 4 reserved words
_COUNTERS = struct.Struct("<32Q4Q")
_CONTROL_SIZE = _OPS_AT + _COUNTERS.size
_BUSY_SIZE = (1 << 20) * 4


@dataclasses.dataclass(frozen=True)
class Faults:
    """What one mount does wrong (all off: a plain, coherent passthrough)."""

    latency_us: int = 0
    stale_unlinked: bool = False
    ebusy_open: bool = False
    attr_timeout_ms: int = 0
    estale_ppm: int = 0
    eio_ppm: int = 0
    ebusy_ppm: int = 0
    estale_ops: tuple[str, ...] = ()
    eio_ops: tuple[str, ...] = ()
    ebusy_ops: tuple[str, ...] = ()

    def pack(self) -> bytes:
        ints = (self.latency_us, self.stale_unlinked, self.ebusy_open, self.attr_timeout_ms)
        rates = (self.estale_ppm, self.eio_ppm, self.ebusy_ppm, 0)
        masks = (_mask(self.estale_ops), _mask(self.eio_ops), _mask(self.ebusy_ops))
        return _SETTINGS.pack(_MAGIC, *map(int, ints), *rates, *masks)


NO_FAULTS = Faults()


def _mask(ops: tuple[str, ...]) -> int:
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown request kinds {sorted(unknown)}; known: {OPS}")
    return sum(1 << OPS.index(op) for op in ops)


class Node:
    """One mount: its path, its faults (settable while mounted) and its request counters."""

    def __init__(self, path: Path, control: Path) -> None:
        self.path = path
        self.control = control
        self.process: subprocess.Popen[bytes] | None = None
        with open(control, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _CONTROL_SIZE)

    def set(self, faults: Faults) -> None:
        self._map[: _SETTINGS.size] = faults.pack()

    def counts(self) -> dict[str, int]:
        """Requests answered so far, by kind, and the faults injected (``injected_<kind>``)."""
        values = _COUNTERS.unpack_from(self._map, _OPS_AT)
        out = dict(zip(OPS, values, strict=False))
        out.update({f"injected_{k}": v for k, v in zip(INJECTED, values[32:], strict=True)})
        return out

    def round_trips(self, before: dict[str, int] | None = None) -> int:
        """Requests that wait for the server on NFS, since ``before`` (a :meth:`counts`)."""
        now, before = self.counts(), before or {}
        return sum(now[op] - before.get(op, 0) for op in OPS if op not in NOT_ROUND_TRIPS)

    def close(self) -> None:
        self._map.close()


def unavailable() -> str | None:
    """Why FUSE cannot be used here, or ``None``."""
    if not os.path.exists("/dev/fuse"):
        return SKIP_REASON.format("no /dev/fuse")
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return SKIP_REASON.format("not root and no fusermount3")
    if shutil.which("cc") is None:
        return SKIP_REASON.format("no C compiler (cc)")
    if not Path("/usr/include/fuse3/fuse_lowlevel.h").exists():
        return SKIP_REASON.format("no libfuse3 headers (/usr/include/fuse3)")
    return None


def binary() -> Path:
    """The compiled filesystem, built once per version of its source."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernelcache-tests"
    out = cache / f"netfs-{digest}"
    if out.exists():
        return out
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:  # a read-only home: build under the test run's temporary directory
        cache = Path(tempfile.mkdtemp(prefix="kernelcache-netfs-"))
        out = cache / f"netfs-{digest}"
    tmp = cache / f".netfs-{digest}.{os.getpid()}"
    cmd = [
        "cc",
        "-O2",
        "-Wall",
        "-o",
        str(tmp),
        str(SOURCE),
        "-I/usr/include/fuse3",
        "-lfuse3",
        "-lpthread",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building netfs failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)
    return out


class MountRefused(RuntimeError):
    """The kernel or fusermount refused the mount (no permission): FUSE is unavailable here."""


class NetFS:
    """Two mounts of one backing directory (``nodes``), unmounted by :meth:`close`.

    ``root`` is an empty directory that this object owns; ``flock`` is the
    lock behaviour of both mounts (see the module docstring).
    """

    def __init__(self, root: Path, flock: str = "local", faults: Faults = NO_FAULTS) -> None:
        if flock not in ("local", "none", "shared"):
            raise ValueError(f"flock must be 'local', 'none' or 'shared', not {flock!r}")
        self.root = root
        self.backing = root / "backing"
        self.backing.mkdir(mode=0o700)
        busy = root / "busy"
        busy.write_bytes(b"")
        os.truncate(busy, _BUSY_SIZE)
        self.nodes: list[Node] = []
        try:
            for name in ("a", "b"):
                self.nodes.append(self._mount(name, busy, flock, faults))
        except BaseException:
            self.close()
            raise

    def _mount(self, name: str, busy: Path, flock: str, faults: Faults) -> Node:
        path, control = self.root / name, self.root / f"{name}.control"
        path.mkdir(mode=0o700)
        control.write_bytes(b"\0" * _CONTROL_SIZE)
        node = Node(path, control)
        node.set(faults)
        self.nodes.append(node)  # closed by close() even if the mount fails
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (the daemon's stderr, kept open)
        with log:
            args = [str(binary()), str(self.backing), str(path), str(control), str(busy), flock]
            node.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not os.path.ismount(path):
            if node.process.poll() is not None:
                text = (self.root / f"{name}.log").read_text(errors="replace")
                if "not permitted" in text or "Permission denied" in text:
                    raise MountRefused(text)
                raise RuntimeError(f"netfs exited with {node.process.returncode}: {text}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"netfs did not mount {path} within 20 s")
            time.sleep(0.01)
        self.nodes.pop()
        return node

    def close(self) -> None:
        """Unmount both nodes and stop their daemons; nothing is left mounted or running."""
        for node in self.nodes:
            _unmount(node)
            node.close()
        self.nodes = []

    def __enter__(self) -> NetFS:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _unmount(node: Node) -> None:
    proc = node.process
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the daemon unmounts itself (lazily) on its way out
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    if os.path.ismount(node.path):
        for cmd in (["fusermount3", "-u", "-z"], ["umount", "-l"]):
            if (
                shutil.which(cmd[0])
                and subprocess.run([*cmd, str(node.path)], capture_output=True).returncode == 0
            ):
                break
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def mounted(root: Path, flock: str = "local", faults: Faults = NO_FAULTS) -> Iterator[NetFS]:
    """:class:`NetFS` as a context manager."""
    fs = NetFS(root, flock, faults)
    try:
        yield fs
    finally:
        fs.close()


def is_fault(exc: OSError) -> bool:
    """An error that netfs injects (what a network filesystem may answer)."""
    return exc.errno in (errno.ESTALE, errno.EIO, errno.EBUSY, errno.ENOLCK)
