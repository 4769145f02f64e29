"""Which filesystem a cache directory lives on, and whether it is a network one.

On most GPU clusters ``$HOME`` (and so the default cache directory) is NFS,
Lustre or GPFS, where ``flock`` may not conflict across nodes and attribute
caching makes another node's change look like none (issue 22). The disk
tier asks :func:`detect` once per directory and process, and applies its
network rules (lease locks, no stat trusted across processes) only where
the answer is network: the local-disk hit path stays as it is.

How: the directory's ``st_dev`` is looked up in ``/proc/self/mountinfo``,
whose ``major:minor`` field names the very superblock (no path-prefix
guessing through bind mounts and symlinks); where nothing matches (btrfs
subvolumes report their own device) the longest mount point above the
resolved path decides. Chosen over ``statfs(2)`` because Python has no
``os.statfs`` (``ctypes`` would cost ~5 ms of import on the launcher's start
and a per-architecture ``struct statfs`` layout), and because mountinfo names
what ``f_type`` cannot tell apart: every FUSE filesystem shares one magic
number, mountinfo says ``fuse.sshfs`` or ``fuse.glusterfs``, and ``nfs4`` vs
``nfs``. Without ``/proc`` (not Linux) the type is ``unknown``, not network.

Every FUSE filesystem counts as network: a FUSE store's ``flock`` is
local to one mount (it never conflicts across nodes), and most FUSE stores
in HPC (sshfs, GlusterFS, JuiceFS, gcsfuse, s3fs) are remote. ``fuseblk``
(ntfs-3g and the like, a local disk) does not.
"""

from __future__ import annotations

import os

#: Filesystem types (mountinfo's names) that are shared between machines.
NETWORK_TYPES = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cifs", "smb3", "smbfs",
        "9p", "afs", "glusterfs", "virtiofs", "pvfs2", "orangefs", "ocfs2", "gfs2",
        "wekafs", "panfs", "quobyte", "vboxsf", "davfs", "ncpfs", "coda", "fuse",
    }
)  # fmt: skip
_MOUNTINFO = "/proc/self/mountinfo"


class FsType:
    """A directory's filesystem: its type as the kernel names it, and whether it is shared.

    (A plain class: :mod:`kernelcache._fs` imports this module on the launcher's
    start, which avoids importing ``dataclasses``.)
    """

    __slots__ = ("name", "network")

    def __init__(self, name: str, network: bool) -> None:
        self.name = name
        self.network = network

    def __repr__(self) -> str:
        return f"FsType({self.name!r}, network={self.network})"

    def __str__(self) -> str:
        return f"{self.name} (network)" if self.network else self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FsType) and (self.name, self.network) == (
            other.name,
            other.network,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.network))


UNKNOWN = FsType("unknown", False)
_by_dev: dict[int, FsType] = {}
_warned: set[str] = set()


def is_network_type(name: str) -> bool:
    """Whether a mountinfo filesystem type names a network (shared) filesystem."""
    return name in NETWORK_TYPES or (name.startswith("fuse.") and name != "fuse.fuseblk")


def detect(path: str) -> FsType:
    """The filesystem ``path`` is on (the nearest existing ancestor's if it does not exist
    yet: a cache directory about to be made); remembered per device."""
    while True:
        try:
            dev = os.stat(path).st_dev
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return UNKNOWN
            path = parent
        except OSError:
            return UNKNOWN
    found = _by_dev.get(dev)
    if found is None:
        name = _from_mountinfo(path, dev)
        found = _by_dev[dev] = FsType(name, is_network_type(name))
    return found


def network_device(dev: int) -> bool:
    """Whether the device ``dev`` (a stat's ``st_dev``) is a network filesystem's mount.

    For :func:`kernelcache._fs.too_new`: a stat from such a filesystem never
    vouches for a file's content (another node's change may not show in it).
    """
    found = _by_dev.get(dev)
    if found is None:
        name = _from_mountinfo(None, dev)
        found = _by_dev[dev] = FsType(name, is_network_type(name))
    return found.network


def is_network(path: str) -> bool:
    """Whether ``path`` is on a network filesystem (where the disk tier's network rules apply)."""
    return detect(path).network


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in octal (\040 ...).
    if "\\" not in field:
        return field
    return field.encode("latin-1").decode("unicode_escape").encode("latin-1").decode()


def _fstype(line: str) -> str | None:
    """The filesystem type of one mountinfo line (after the ``-`` that ends its optional fields)."""
    fields = line.split(" ")
    try:
        return fields[fields.index("-", 6) + 1]
    except (ValueError, IndexError):
        return None  # not a line mountinfo writes


def _from_mountinfo(path: str | None, dev: int) -> str:
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError:
        return "unknown"
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    # The device's own line, found without splitting every line: a cluster node's mountinfo
    # runs to hundreds of lines, and each Cache() asks (420 lines: 0.59 ms split, 0.15 ms
    # found). Fields hold no spaces (mountinfo escapes them), so " 0:52 " is a whole field;
    # only the third decides.
    start = text.find(f" {wanted} ")
    while start >= 0:
        begin = text.rfind("\n", 0, start) + 1
        end = text.find("\n", start)
        line = text[begin : end if end >= 0 else len(text)]
        fstype = _fstype(line)
        if fstype is not None and line.split(" ", 3)[2] == wanted:
            return fstype
        start = text.find(f" {wanted} ", start + 1)
    mounts: list[tuple[str, str]] = []
    for line in text.splitlines():
        fstype = _fstype(line)
        if fstype is not None:
            mounts.append((_unescape(line.split(" ", 5)[4]), fstype))
    if path is None:
        return "unknown"
    # No device matched (btrfs subvolumes): the longest mount point above the real path.
    real = os.path.realpath(path)
    best, name = -1, "unknown"
    for point, fstype in mounts:
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, name = len(point), fstype
    return name


def assume(path: str, name: str) -> FsType:
    """Take ``path``'s filesystem to be ``name`` (a mountinfo type) in this process, from now on.

    For tests, and for what mountinfo cannot know (a FUSE mount that is local).
    """
    found = _by_dev[os.stat(path).st_dev] = FsType(name, is_network_type(name))
    return found


def forget() -> None:
    """Detect every directory afresh, and warn again (tests)."""
    _by_dev.clear()
    _warned.clear()


def report(path: str) -> dict[str, object]:
    """What ``kernelcache stats`` and ``kernelcache config`` show of ``path``'s filesystem."""
    found = detect(path)
    return {"type": found.name, "network": found.network}


def warn_if_network(path: str) -> FsType:
    """Detect ``path``'s filesystem; log one warning per directory and process if it is network."""
    found = detect(path)
    if found.network and path not in _warned:
        _warned.add(path)
        import logging  # deferred: only a network directory needs it

        logging.getLogger("kernelcache").warning(
            "kernelcache: the cache directory %s is on %s, a network filesystem: it works "
            "there (lease locks, no stat trusted across nodes), but every hit costs round "
            "trips to the server. For speed, point KERNELCACHE_DIR at a node-local disk and "
            "share compiles through the team tier (KERNELCACHE_REMOTE=redis://...).",
            path,
            found.name,
        )
    return found
