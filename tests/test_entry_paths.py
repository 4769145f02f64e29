"""Entry.path() on disk-tier entries: one folder per entry, re-extracted when removed.

Guards the shortcut in the disk tier's Extractor.materialize that derives the folder from an
already known path instead of re-hashing every artifact for each name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kernelcache import DiskStore, Entry

ARTIFACTS = {f"k.{ext}": ext.encode() * 100 for ext in ("ttir", "ttgir", "ptx", "cubin", "json")}


def test_all_paths_of_an_entry_share_one_folder(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put("key", Entry(ARTIFACTS))
    entry = store.get("key")
    assert entry is not None
    paths = {name: Path(entry.path(name)) for name in ARTIFACTS}
    assert len({p.parent for p in paths.values()}) == 1
    assert all(p.read_bytes() == ARTIFACTS[n] for n, p in paths.items())


def test_removed_folder_is_extracted_again(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put("key", Entry(ARTIFACTS))
    entry = store.get("key")
    assert entry is not None
    folder = Path(entry.path("k.ttir")).parent
    shutil.rmtree(folder)  # what eviction of the extracted files does
    assert Path(entry.path("k.cubin")).read_bytes() == ARTIFACTS["k.cubin"]
    assert Path(entry.path("k.ttir")).read_bytes() == ARTIFACTS["k.ttir"]
    assert Path(entry.path("k.ttir")).parent == folder


def test_a_new_version_of_the_key_gets_its_own_folder(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put("key", Entry(ARTIFACTS))
    old = store.get("key")
    assert old is not None
    store.put("key", Entry({**ARTIFACTS, "k.cubin": b"other"}))
    new = store.get("key")
    assert new is not None
    assert Path(new.path("k.cubin")).read_bytes() == b"other"
    assert Path(new.path("k.cubin")).parent != Path(old.path("k.cubin")).parent
