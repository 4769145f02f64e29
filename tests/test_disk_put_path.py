"""The disk tier's put path on folders opened once (issue 40): the lookup probe without the
space lease, and the open folders' own checks. The request counts are in test_netfs_puts.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelcache import Entry
from kernelcache.stores import DiskStore
from kernelcache.stores.disk.layout import Layout, UnsafeDirectory, shard_of
from kernelcache.stores.disk.netpublish import probe

KEY = "cd" * 32


def test_a_probe_whose_empty_file_was_published_over_puts_the_entry_back(tmp_path: Path) -> None:
    """No lock keeps a publisher out while the probe looks: an entry put over its empty
    file before it removes that file is what its rename takes. It must see so (a fresh
    look at what it took) and link the entry back."""
    store = DiskStore(tmp_path / "c")
    store.layout.shard_dir(store.layout.entries, shard_of(KEY), create=True)  # made at open on NFS
    path = store.layout.entry_path(KEY)
    published = Entry({"x": b"published meanwhile"}).pack(KEY)
    taken: list[str] = []

    def trash() -> str:
        # Called after the probe made its empty file, before it renames it away:
        # another process publishes the entry over it just then.
        staged = Path(store.layout.staging, "publisher.tmp")
        staged.write_bytes(published)
        os.replace(staged, path)
        taken.append(store.layout.trash())
        return taken[-1]

    probe(path, trash, store.space.discard, store.layout.at)
    assert taken
    assert Path(path).read_bytes() == published  # put back, and the same file
    assert not os.path.lexists(taken[0])  # its second name removed
    assert store.get(KEY) == Entry({"x": b"published meanwhile"})
    store.close()


def test_a_probe_that_finds_no_entry_leaves_none(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.layout.shard_dir(store.layout.entries, shard_of(KEY), create=True)
    path = store.layout.entry_path(KEY)
    probe(path, store.layout.trash, store.space.discard, store.layout.at)
    assert not os.path.lexists(path)
    assert os.listdir(store.layout.staging) == []
    store.close()


@pytest.mark.parametrize("planted", ["link", "writable"])
def test_an_open_folder_is_checked_as_it_is_opened(tmp_path: Path, planted: str) -> None:
    refused: list[int] = []
    layout = Layout(str(tmp_path / "c"), on_refused=lambda: refused.append(1))
    layout.check_root(create=True)
    layout.ensure(create=True)
    staging = Path(layout.staging)
    if planted == "link":
        staging.rmdir()
        (tmp_path / "elsewhere").mkdir()
        staging.symlink_to(tmp_path / "elsewhere")
    else:
        staging.chmod(0o777)  # others could plant files where entries are staged
    with pytest.raises(UnsafeDirectory):
        layout.at(f"{layout.staging}/x.tmp")
    assert refused == [1]
    assert layout.at(f"{layout.staging}/k/x") == (None, f"{layout.staging}/k/x")  # not kept
    layout.close()
