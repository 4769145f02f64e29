"""The disk tier's extracted artifacts: real files for ``Entry.path()``, always the verified bytes.

Loaders (``cuModuleLoad``, ``dlopen``, Triton) want file names, so the
artifacts of an entry are extracted once into ``v1/extracted/<s>/<key>/<tag>/``,
where ``tag`` is the entry's content digest: a re-published key gets a new
folder and never changes files a loader is using. A folder is written in
staging and renamed into place, so it appears complete or not at all.

A file is handed out only after its bytes were compared with the entry's
verified bytes, once per process; it is then trusted while its stat
signature is unchanged (:func:`kernelcache._fs.holds`), so a file altered in
place or replaced is never served: it is removed and extracted again.
No symlink is followed: the key's folder and the version folder are checked
with ``lstat`` and files opened with ``O_NOFOLLOW``.

A tier that may not write (read-only) serves copies that are there and
verified, and otherwise raises :class:`StoreError`, so that ``Entry.path``
writes a private copy instead of touching the shared directory.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from kernelcache import _fs
from kernelcache.errors import StoreError
from kernelcache.stores.disk.layout import TAG_LENGTH, Layout, is_tag, remove_tree

if TYPE_CHECKING:
    from collections.abc import Callable

    from kernelcache.entry import Entry
    from kernelcache.stores.disk.space import Space


class Extractor:
    """``Entry.path`` for the entries of one disk tier (implements :class:`kernelcache.entry.Files`).

    ``space`` is ``None`` for a tier that may not write; ``on_error`` is
    called for each OS error (the store counts them).
    """

    def __init__(
        self,
        layout: Layout,
        space: Space | None,
        *,
        durable: bool = False,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.space = space
        self.durable = durable
        self._on_error = on_error
        self._pins: dict[str, tuple[int, int, int, int, int]] = {}

    def folder(self, entry: Entry, key: str) -> str:
        """The version folder of ``entry``'s copies under ``key``."""
        # Entry.digest() is computed once per entry: hashing every artifact for
        # each name made n path() calls cost n^2 (~140 us for a 7-file Triton group).
        return f"{self.layout.key_folder(key)}/{entry.digest()[:TAG_LENGTH]}"

    def path(self, entry: Entry, name: str) -> str:
        """The path of artifact ``name`` of ``entry``, extracted (again) if needed."""
        key = entry.key or ""
        folder = self.folder(entry, key)
        target = f"{folder}/{name}"
        data = entry[name]
        try:
            if self.serves(folder, target, data):
                return target
            if self.space is None:
                raise StoreError(f"{target} is not there and this tier may not write")
            self._extract(entry, key, folder)
            if self.serves(folder, target, data):
                return target
        except OSError as exc:
            if self._on_error is not None:
                self._on_error()
            raise StoreError(f"cannot extract {name!r} of {key}: {exc}") from exc
        # Evicted at once (an entry larger than the cap allows) or removed meanwhile.
        raise StoreError(f"{target} was removed as soon as it was extracted")

    def serves(self, folder: str, target: str, data: bytes) -> bool:
        """Whether ``target`` (in ``folder``) may be handed out: real folders, the very bytes."""
        try:
            st = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if stat.S_ISREG(st.st_mode) and self._pins.get(target) == _fs.signature(st):
            # Checked before, unchanged since: a folder swapped for a link would
            # show another inode here, so the folders need no second look.
            return True
        if stat.S_ISLNK(st.st_mode):
            self.layout.refused()  # never followed: the copy is extracted again
        key_folder = os.path.dirname(folder)
        shard = os.path.basename(os.path.dirname(key_folder))
        self.layout.shard_dir(self.layout.extracted, shard, create=False)  # checked once
        for path in (key_folder, folder):
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(mode):
                self.layout.refused()  # a link or a file: never followed
                return False
        return _fs.holds(target, data, self._pins)

    def _extract(self, entry: Entry, key: str, folder: str) -> None:
        assert self.space is not None
        key_folder = os.path.dirname(folder)
        try:
            st = os.lstat(key_folder)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISDIR(st.st_mode):
                # A link (or a file) where the key's folder belongs: the link itself
                # goes (renamed, never followed), not what it points to.
                self.space.drop_folder(key_folder, expect_ino=st.st_ino)
        try:
            st = os.lstat(folder)
        except (FileNotFoundError, NotADirectoryError):
            pass
        else:
            if all(self.serves(folder, f"{folder}/{n}", d) for n, d in entry.items()):
                return  # extracted by another thread or process since the caller looked
            # Damaged (a file missing, altered or replaced): a loader must not get it.
            # Only this very folder: one another process puts in its place stays.
            self.space.drop_folder(folder, expect_ino=st.st_ino)
        staged = self.layout.staged("extract")
        os.mkdir(staged, 0o700)
        try:
            for name, data in entry.items():
                _fs.write_new(f"{staged}/{name}", [data], durable=self.durable)
            size = sum(map(len, entry.values()))
            self.space.add_extraction(key, staged, os.path.basename(folder), size)
        finally:
            # Placed (renamed away), or not (a race lost, the entry gone, disk full):
            # nothing of ours stays in staging either way.
            remove_tree(staged)

    def check(self, entry: Entry, key: str) -> list[tuple[str, str]]:
        """Problems of the extracted copies of ``entry`` (for ``kernelcache verify``).

        Every version folder of the key is compared with the entry: a folder
        of another version is stale, a file that differs from the verified
        bytes (or is not a regular file) is damaged.
        """
        problems: list[tuple[str, str]] = []
        base = self.layout.key_folder(key)
        current = os.path.basename(self.folder(entry, key))
        if not _is_dir(base):
            return [(base, "not a directory (a link or a file)")] if os.path.lexists(base) else []
        for tag in sorted(os.listdir(base)):
            folder = f"{base}/{tag}"
            if not is_tag(tag):
                problems.append((folder, "not a version folder of extracted copies"))
            elif tag != current:
                problems.append((folder, "extracted copies of another version of the entry"))
            elif not _is_dir(folder):
                problems.append((folder, "not a directory (a link or a file)"))
            else:
                for name in sorted(os.listdir(folder)):
                    target = f"{folder}/{name}"
                    if name not in entry:
                        problems.append((target, "extracted file of no artifact of the entry"))
                    elif not _fs.holds(target, entry[name], {}):
                        problems.append((target, "extracted file differs from the verified bytes"))
        return problems

    def remove_copies(self, key: str) -> None:
        """Remove every extracted version of ``key`` (``verify --fix``)."""
        assert self.space is not None
        base = self.layout.key_folder(key)
        try:
            tags = os.listdir(base) if stat.S_ISDIR(os.lstat(base).st_mode) else []
        except FileNotFoundError:
            return
        for tag in tags:
            self.space.drop_folder(f"{base}/{tag}")


def _is_dir(path: str) -> bool:
    """Whether ``path`` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
