"""Files handed to loaders are the verified bytes; nothing in the tree is followed or trusted
blindly; a directory others can write to is refused (issue 10)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from disk_entries import read_only
from kernelcache import Cache, Entry, Settings, StoreError, _fs
from kernelcache.stores.disk import DiskStore, shard_of

KEY = "k" * 32
ARTIFACT = b"\x7fELF" + bytes(range(256)) * 40
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about entry files (damaged, linked, aged, counted): small entries go
    into files here, as before packing. Packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def entry() -> Entry:
    return Entry({"kernel.cubin": ARTIFACT, "log": b"ok"})


def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir(exist_ok=True)
    return path


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# Files handed to loaders -------------------------------------------------
@pytest.mark.parametrize("pinned", [False, True], ids=["fresh", "pinned"])
@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_an_altered_extracted_file_is_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, pinned: bool
) -> None:
    if pinned:  # the file was verified once and is trusted by its stat signature since
        monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)
    store = DiskStore(tmp_path / "c")
    store.put(KEY, entry())
    got = store.get(KEY)
    assert got is not None
    path = Path(got.path("kernel.cubin"))
    assert path.read_bytes() == ARTIFACT
    evil = bytes(len(ARTIFACT))  # same size: a size check cannot tell
    if how == "in-place":
        with open(path, "r+b") as f:
            f.write(evil)
    else:
        staged = tmp_path / "evil"
        staged.write_bytes(evil)
        os.replace(staged, path)
    for holder in (got, store.get(KEY)):
        assert holder is not None
        assert Path(holder.path("kernel.cubin")).read_bytes() == ARTIFACT


def test_verify_checks_extracted_files(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with Cache(settings=Settings.load(dir=str(root))) as cache:
        cache.put(KEY, entry())
        path = Path(cache.get(KEY).path("kernel.cubin"))  # type: ignore[union-attr]
    with open(path, "r+b") as f:
        f.write(b"\0" * 16)
    proc = kc(root, "verify")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "extracted" in proc.stdout, proc.stdout + proc.stderr
    assert kc(root, "verify", "--fix").returncode == 0
    assert kc(root, "verify").returncode == 0
    store = DiskStore(root)
    found = store.get(KEY)  # removed by --fix, or extracted again from the verified bytes
    assert found is None or Path(found.path("kernel.cubin")).read_bytes() == ARTIFACT


def kc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCACHE_")}
    env["PYTHONPATH"] = SRC
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", "--dir", str(root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


# No symlink is followed ----------------------------------------------------
def test_a_symlink_at_an_entry_file_is_not_followed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.put("other", entry())  # makes the layout
    planted = outside(tmp_path) / "planted.kce"
    planted.write_bytes(entry().pack(KEY))  # a valid entry, outside the cache
    (path,) = Path(store.path).glob("v1/entries/*/other.kce")
    link = path.parent.parent / shard_of(KEY) / f"{KEY}.kce"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(planted)
    assert store.get(KEY) is None
    assert store.counters.refused == 1
    assert planted.read_bytes() == entry().pack(KEY)


def test_a_symlinked_extraction_folder_is_not_followed(tmp_path: Path) -> None:
    """Another's folder with the right bytes behind a link: verified now, swapped later."""
    store = DiskStore(tmp_path / "c")
    store.put(KEY, entry())
    got = store.get(KEY)
    assert got is not None
    folder = Path(got.path("kernel.cubin")).parent.parent  # the key's folder
    elsewhere = outside(tmp_path) / "copies"
    shutil.copytree(folder, elsewhere)
    shutil.rmtree(folder)
    folder.symlink_to(elsewhere)
    before = files_under(elsewhere)
    again = store.get(KEY)
    assert again is not None
    path = Path(again.path("kernel.cubin"))
    assert path.read_bytes() == ARTIFACT
    assert not path.resolve().is_relative_to(elsewhere)
    assert store.counters.refused >= 1
    assert files_under(elsewhere) == before  # what the link pointed to is left alone


def test_a_symlink_at_the_counter_file_makes_no_write_outside(tmp_path: Path) -> None:
    root = tmp_path / "c"
    store = DiskStore(root)
    store.put("first", entry())
    store.close()
    victim = outside(tmp_path) / "victim"
    victim.write_bytes(b"precious")
    counters = [root / "v1" / "space"]
    if (root / "v1" / "shards").is_dir():  # where older versions kept per-shard counters
        counters += [root / "v1" / "shards" / f"{i:x}" for i in range(16)]
    for counter in counters:
        counter.unlink(missing_ok=True)
        counter.symlink_to(victim)
    store = DiskStore(root, max_bytes=1 << 30)
    store.put(KEY, entry())
    assert victim.read_bytes() == b"precious"
    assert store.get(KEY) == entry()


def test_a_symlink_at_a_lock_file_creates_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = Cache([DiskStore(root)])
    target = outside(tmp_path) / "created-by-the-lock"
    lock = root / "v1" / "locks" / shard_of(KEY) / f"{KEY}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.symlink_to(target)
    assert dict(cache.get_or_compile(KEY, entry)) == dict(entry())
    assert not target.exists()


def test_a_symlinked_staging_directory_receives_nothing(tmp_path: Path) -> None:
    root = tmp_path / "c"
    DiskStore(root).put("first", entry())
    staging = root / "v1" / "staging"
    shutil.rmtree(staging)
    elsewhere = outside(tmp_path)
    staging.symlink_to(elsewhere)
    os.utime(elsewhere, ns=(0, 0))  # any file made there (even renamed away) changes this
    store = DiskStore(root)
    with contextlib.suppress(StoreError):
        store.put(KEY, entry())
        got = store.get(KEY)
        assert got is not None
        got.path("kernel.cubin")
    assert files_under(elsewhere) == []
    assert elsewhere.stat().st_mtime_ns == 0
    assert store.counters.refused >= 1


def counted_compile(calls: list[int]) -> Callable[[], Entry]:
    """A compile function that notes each run in ``calls``."""

    def compile_() -> Entry:
        calls.append(1)
        return Entry({"kernel.cubin": b"mine"})

    return compile_


def test_a_symlinked_shard_directory_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "c"
    DiskStore(root).put("first", entry())
    planted = outside(tmp_path)
    (planted / f"{KEY}.kce").write_bytes(entry().pack(KEY))
    shard = root / "v1" / "entries" / shard_of(KEY)
    if shard.exists():
        shutil.rmtree(shard)
    shard.symlink_to(planted)
    cache = Cache([DiskStore(root)])
    calls: list[int] = []
    got = cache.get_or_compile(KEY, counted_compile(calls))
    assert calls == [1]
    assert got["kernel.cubin"] == b"mine"


def test_a_shard_directory_swapped_for_a_link_after_use_is_not_followed(tmp_path: Path) -> None:
    """Hits open entries relative to the shard directory that was checked, so a link put
    in its place later leads nowhere (a path walk would follow it to a planted entry)."""
    root = tmp_path / "c"
    store = DiskStore(root)
    store.put(KEY, entry())
    assert store.get(KEY) == entry()  # the shard directory is checked and in use now
    planted = outside(tmp_path)
    (planted / f"{KEY}.kce").write_bytes(Entry({"kernel.cubin": b"planted"}).pack(KEY))
    shard = root / "v1" / "entries" / shard_of(KEY)
    shard.rename(tmp_path / "moved-away")
    shard.symlink_to(planted)
    got = store.get(KEY)
    assert got is None or got["kernel.cubin"] == ARTIFACT


def test_a_store_closes_the_directories_it_opened(tmp_path: Path) -> None:
    root = str(tmp_path / "c")

    def open_fds() -> int:
        """Descriptors of this process open in the store's tree. Not all of them: threads
        that earlier tests in this worker left (a lease's renewer, a flock waiter that gave
        up and closes its file once it gets the lock) open and close others meanwhile."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed since the listing
                target = os.readlink(f"/proc/self/fd/{fd}")
                count += target == root or target.startswith(root + os.sep)
        return count

    store = DiskStore(root)
    keys = [f"k{i}" for i in range(64)]  # every shard
    for key in keys:
        store.put(key, entry())
        assert store.get(key) is not None
    assert open_fds() > 0
    store.close()
    assert open_fds() == 0
    assert store.get(keys[0]) == entry()  # opened again if used after all
    assert open_fds() > 0
    del store  # and closed when the store is collected
    gc.collect()
    assert open_fds() == 0


# Directories others can write to ------------------------------------------
def poisoned(tmp_path: Path, how: str) -> Path:
    """A cache directory someone else prepared, with an entry planted for KEY."""
    root = tmp_path / "c"
    DiskStore(root).put(KEY, Entry({"kernel.cubin": b"planted"}))
    if how == "world-writable":
        for path in (root, *root.rglob("*")):
            if path.is_dir():
                path.chmod(0o777)
    elif os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    else:
        for path in (root, *root.rglob("*")):
            os.lchown(path, 4242, 4242)
    return root


@pytest.mark.parametrize("how", ["world-writable", "owned-by-another-user"])
def test_a_directory_others_can_write_is_refused_and_the_cache_still_works(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = poisoned(tmp_path, how)
    before = files_under(root)
    with Cache(settings=Settings.load(dir=str(root))) as cache:
        calls: list[int] = []
        got = cache.get_or_compile(KEY, counted_compile(calls))
        assert calls == [1]
        assert got["kernel.cubin"] == b"mine"  # compiled, not served
        again = cache.get(KEY)  # from the memory tier
        assert again is not None
        assert again["kernel.cubin"] == b"mine"
        disk = cache.tiers[1]
        assert isinstance(disk, DiskStore)
        assert disk.unusable is not None
        assert disk.counters.refused == 1
        cache.flush_stats()
    assert "refusing cache directory" in caplog.text
    assert files_under(root) == before  # nothing written there, statistics included
    with pytest.raises(StoreError, match="refusing cache directory"):
        DiskStore(root).get(KEY)


# Read-only media and broken layouts ---------------------------------------
def test_cache_works_on_a_read_only_cache_directory(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with Cache(settings=Settings.load(dir=str(root))) as cache:
        cache.put(KEY, entry())
    with read_only(root), Cache(settings=Settings.load(dir=str(root))) as cache:
        got = cache.get(KEY)
        assert got == entry()
        assert Path(got.path("kernel.cubin")).read_bytes() == ARTIFACT
        assert cache.get_or_compile("j" * 32, lambda: b"new")["data"] == b"new"
        cache.flush_stats()


def test_cache_works_when_staging_is_a_file(tmp_path: Path) -> None:
    root = tmp_path / "c"
    DiskStore(root).put("first", entry())
    staging = root / "v1" / "staging"
    shutil.rmtree(staging)
    staging.write_bytes(b"not a directory")
    with Cache(settings=Settings.load(dir=str(root))) as cache:
        assert dict(cache.get_or_compile(KEY, entry)) == dict(entry())
        assert cache.get("first") == entry()
    assert dict(DiskStore(root).get(KEY) or {}) == dict(entry())  # stored: layout repaired


def test_a_failed_extraction_leaves_nothing_in_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path / "c")
    store.put(KEY, entry())
    got = store.get(KEY)
    assert got is not None
    real_writev = os.writev
    writes = []

    def disk_full(fd: int, buffers: list[bytes]) -> int:
        # Only the tier's disk is full: the private copy (in /tmp) must be written even
        # when no earlier test in this process wrote these bytes there already.
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(store.path)):
            writes.append(fd)
            if len(writes) > 1:  # the first artifact is written, then the disk is full
                raise OSError(28, "No space left on device")
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", disk_full)
    path = Path(got.path("kernel.cubin"))
    monkeypatch.undo()
    assert path.read_bytes() == ARTIFACT  # a private copy serves the loader
    assert not path.is_relative_to(store.path)
    assert os.listdir(store.layout.staging) == []
    assert store.counters.errors == 1


@pytest.mark.parametrize("top", ["entries", "extracted"])
def test_a_symlinked_shard_is_never_scanned_or_cleaned(tmp_path: Path, top: str) -> None:
    """A scan through a link would count what lies elsewhere, and clean it as orphans."""
    root = tmp_path / "c"
    store = DiskStore(root, max_bytes=64 << 10)
    store.put(KEY, entry())
    shard = shard_of("projects")
    elsewhere = outside(tmp_path)
    (elsewhere / "projects").mkdir()  # named like a key of that shard, with no entry
    (elsewhere / "projects" / "work.txt").write_bytes(b"precious")
    (elsewhere / "projects.kce").write_bytes(b"precious")
    link = root / "v1" / top / shard
    if link.exists():
        shutil.rmtree(link)
    link.symlink_to(elsewhere)
    before = files_under(elsewhere)
    store.recount()
    for i in range(40):  # over the cap: evictions, rescans, removals
        store.put(f"p{i}", Entry({"kernel.cubin": bytes([i]) * 4000}))
        got = store.get(f"p{i}")
        assert got is not None
        got.path("kernel.cubin")
    store.clear()
    assert files_under(elsewhere) == before
    assert store.counters.refused >= 1
