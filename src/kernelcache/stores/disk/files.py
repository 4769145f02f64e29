"""The disk tier's extracted artifacts: real files for ``Entry.path()``.

Loaders (``cuModuleLoad``, Triton) want file names, so the artifacts of an
entry are extracted once into ``v1/files/<s>/<key>.<tag>/``, where ``tag`` is
the xxh3_64 of the entry's contents: a re-published key gets a new folder and
never changes files a loader is using. A folder is written in staging and
renamed into place, so it appears complete or not at all; it is removed by
renaming it back into staging first. Its bytes count towards the shard's size.

Internal to :class:`~kernelcache.stores.disk.DiskStore`, which owns one
:class:`Extractor`.
"""

from __future__ import annotations

import errno
import os

from kernelcache._fs import unique, write_new
from kernelcache.stores.base import is_valid_key
from kernelcache.stores.disk.space import shard_of, tree_size

# Not typing.TYPE_CHECKING: importing typing costs ~3 ms on the launcher's hit path.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from kernelcache.entry import Entry
    from kernelcache.stores.disk import DiskStore

_TAG_LENGTH = 16  # a tag: the first 16 hex digits of the entry's Entry.digest()


class Extractor:
    """Extracts, lists and removes the artifact folders of one :class:`DiskStore`."""

    def __init__(self, store: DiskStore) -> None:
        self._store = store
        self._files = store._files
        self._staging = store._staging

    def path(self, entry: Entry, name: str) -> str:
        """The path of artifact ``name`` of ``entry``, extracted if needed (``Entry.path``)."""
        key = entry.key or ""
        shard = shard_of(key)
        # Entry.digest() is computed once per entry: hashing every artifact for
        # each name made n path() calls cost n^2 (~140 us for a 7-file Triton group).
        folder = f"{self._files}/{shard}/{key}.{entry.digest()[:_TAG_LENGTH]}"
        target = os.path.join(folder, name)

        def extract() -> None:
            try:
                if os.path.getsize(target) == len(entry[name]):
                    return
            except FileNotFoundError:
                pass  # not extracted yet
            self._extract(entry, folder, shard)

        self._store._guard(extract)  # other OS errors: a broken tier, counted
        return target

    def _extract(self, entry: Entry, folder: str, shard: str) -> None:
        space = self._store._space
        if os.path.isdir(folder):
            if _is_complete(folder, entry):
                # Another thread or process extracted it since the caller looked;
                # removing it would pull the file from under a loader using it.
                return
            freed = self.rmtree(folder)  # damaged (a file missing or cut): redo it
            space.account(shard, -freed, 0)
        staging = f"{self._staging}/extract.{unique()}"
        os.mkdir(staging, 0o700)
        for name, data in entry.items():
            write_new(os.path.join(staging, name), [data], durable=self._store.durable)
        try:
            os.rename(staging, folder)
        except OSError as exc:
            import shutil  # deferred: off the launcher's hit path

            shutil.rmtree(staging)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return  # benign race: another process extracted the same entry first
        space.account(shard, sum(map(len, entry.values())), 0)

    def folders(self, shard: str) -> dict[str, list[str]]:
        """Every extracted folder of a shard, by key (one listing of files/<shard>)."""
        folders: dict[str, list[str]] = {}
        with os.scandir(f"{self._files}/{shard}") as it:
            for item in it:
                key = _extracted_key(item)
                if key is not None:  # else foreign: neither counted nor touched
                    folders.setdefault(key, []).append(item.path)
        return folders

    def remove(self, key: str, shard: str) -> int:
        """Remove the extracted folders of ``key``; returns the bytes freed."""
        freed = 0
        # An exact match: a prefix test would also take key "a.b"'s files for key "a".
        with os.scandir(f"{self._files}/{shard}") as it:
            folders = [item.path for item in it if _extracted_key(item) == key]
        for folder in folders:
            freed += self.rmtree(folder)
        return freed

    def rmtree(self, folder: str) -> int:
        """Take ``folder`` away at once (a rename into staging), then delete it; returns its bytes."""
        trash = f"{self._staging}/trash.{unique()}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return 0
        size = tree_size(trash)
        import shutil  # deferred: off the launcher's hit path

        shutil.rmtree(trash)
        return size


def _is_complete(folder: str, entry: Entry) -> bool:
    try:
        return all(os.path.getsize(os.path.join(folder, n)) == len(d) for n, d in entry.items())
    except FileNotFoundError:
        return False


def _is_tag(text: str) -> bool:
    """Whether ``text`` is a folder tag, ``[0-9a-f]{16}``, checked without importing ``re``."""
    return len(text) == _TAG_LENGTH and not text.strip("0123456789abcdef")


def _extracted_key(item: os.DirEntry[str]) -> str | None:
    """The key of extraction directory ``<key>.<tag>``, or ``None`` for a foreign item
    (a foreign file there made cleaning fail with NotADirectoryError)."""
    key, _, tag = item.name.rpartition(".")
    if not _is_tag(tag) or not is_valid_key(key):
        return None
    return key if item.is_dir(follow_symlinks=False) else None
