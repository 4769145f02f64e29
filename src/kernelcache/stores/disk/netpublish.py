"""Publishing an entry on a network filesystem, where ``lstat`` may answer from a stale cache.

On NFS (``actimeo``) a ``stat`` of the entry's name may still say "no entry"
after another node published one, or show the inode it replaced; counting
from it makes the tier's counter run high, and eviction then empties the
cache to bring a phantom total under the cap (issue 22 measured 3 entries
left, a 38 % hit rate, at 1 s of attribute caching). ``link()`` asks the
server whether the name is taken; only a name that is taken is opened
(``open`` revalidates: close-to-open) to learn the size it replaces.

The same cache must not decide the lease holder's lookup (:func:`probe`) nor
which file a removal took (:func:`lstat_fresh`): both begin with an exclusive
create, which no client answers from its cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Protocol

from kernelcache._fs import exists_afresh

if TYPE_CHECKING:
    from collections.abc import Callable

    #: A path as its open folder and its name (``Layout.at``), for ``os``'s ``dir_fd``
    #: arguments: on a network filesystem every folder of a path walked is a lookup.
    At = Callable[[str], tuple[int | None, str]]


def here(path: str) -> tuple[int | None, str]:
    """``path`` itself, walked whole (no open folder): the default ``At``."""
    return None, path


class Tally(Protocol):
    """The space counter while its lock is held (:class:`.space.Tally`)."""

    def add(self, delta_bytes: int, delta_entries: int) -> None: ...


def link_in(
    tally: Tally, tmp: str, path: str, size: int, discard: Callable[[str], None], at: At = here
) -> None:
    """Publish on a network filesystem, where ``lstat`` may answer from a cache that
    lags another node (no entry, or the inode it replaced): ``link()`` asks the
    server whether the name is taken, so the counter stays exact."""
    tally.add(size, 1)
    (src_fd, src), (dst_fd, dst) = at(tmp), at(path)
    try:
        os.link(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    except FileExistsError:
        tally.add(-size, -1)
        _replace(tally, tmp, path, size, discard)
        return
    except BaseException:
        tally.add(-size, -1)
        raise
    discard(tmp)


def _replace(tally: Tally, tmp: str, path: str, size: int, discard: Callable[[str], None]) -> None:
    mine = os.lstat(tmp).st_ino
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:  # gone meanwhile, or a link (replaced, never followed)
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            raise
        old, new = 0, 1
    else:
        try:
            st = os.fstat(fd)  # after an open: close-to-open revalidated it
        finally:
            os.close(fd)
        if st.st_ino == mine:  # our own link, its reply lost and retried: done
            tally.add(size, 1)
            discard(tmp)
            return
        old, new = replaced(st)
    replace_counted(tally, tmp, path, size, old, new)


def lstat_fresh(path: str, at: At = here) -> os.stat_result:
    """``lstat`` of ``path`` as the server has it, where this node may cache the name stale
    (a rename carries the cached name along: a file renamed away by its name may be
    another node's newer file, yet ``lstat`` of the new name shows the one cached)."""
    folder, name = at(path)
    if not exists_afresh(name, folder):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return os.stat(name, dir_fd=folder, follow_symlinks=False)


def probe(path: str, trash: Callable[[], str], doom: Callable[[str], None], at: At = here) -> None:
    """Open the entry ``path`` with ``O_CREAT``: the server answers, so a name this node saw
    absent is looked up afresh. The empty file made when there is no entry is renamed to
    ``trash()`` and handed to ``doom`` (deleted). No lock is needed: an empty file is
    no entry to a removal or a publish (:func:`replaced`, ``Space.remove_locked``).

    Exclusive first: a name this node still caches as another leader's probe file
    (removed since, an entry published there after) would be opened as that empty
    file, and removing "our" file would take the entry. No client trusts a cached
    name for an exclusive create (FUSE looks it up again, NFS asks the server).
    """
    flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    folder, name = at(path)
    try:
        fd = os.open(name, flags | os.O_EXCL, 0o600, dir_fd=folder)
    except FileExistsError:
        # Taken on the server, and looked up afresh here: open what it is now
        # (an NFS client that kept its "no such file" learns the file from this open).
        fd = os.open(name, flags, 0o600, dir_fd=folder)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_size:
        return  # the entry: this node sees it now
    staged = trash()
    staged_fd, staged_name = at(staged)
    try:
        os.rename(name, staged_name, src_dir_fd=folder, dst_dir_fd=staged_fd)
    except FileNotFoundError:
        return
    try:
        # Afresh: no lock keeps publishers out, and the rename took whatever the server
        # holds under the name now, maybe an entry published over our file since.
        taken = lstat_fresh(staged, at).st_ino
    except FileNotFoundError:
        return
    if taken != st.st_ino:  # not ours after all: put back
        with contextlib.suppress(FileExistsError):
            os.link(staged_name, name, src_dir_fd=staged_fd, dst_dir_fd=folder)
    doom(staged)


def replaced(st: os.stat_result) -> tuple[int, int]:
    """What replacing the file ``st`` changes in the counter besides the new entry's size:
    ``(bytes it held, entries added)``. An empty file is no entry (a lookup's probe): not
    counted, so replacing it adds one."""
    return (st.st_size, 0) if stat.S_ISREG(st.st_mode) and st.st_size else (0, 1)


def replace_counted(tally: Tally, tmp: str, path: str, size: int, old: int, new: int) -> None:
    """``os.replace(tmp, path)`` with the counter kept: growth is counted before the rename
    and shrinkage after it, so a crash in between leaves the counter high, never low."""
    grows = max(size - old, 0)
    tally.add(grows, new)
    try:
        # Atomic within one file system: readers see the old entry or the new.
        os.replace(tmp, path)
    except BaseException:
        tally.add(-grows, -new)
        raise
    if size < old:
        tally.add(size - old, 0)
