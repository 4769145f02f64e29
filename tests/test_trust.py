"""The one trust rule (issue 19): a directory and every ancestor belong to you or root, and
nobody else can write them (sticky ancestors excepted); links on the way are yours or root's.

The rule is checked on real trees made by a real second user (``setpriv``),
in Python (:mod:`kernelcache._trust`) and in the compiled client (``client.c``,
``--trusted``), which must agree on every tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kernelcache import _trust
from kernelcache.nvcc import native
from other_user import OTHER, needs_other_user, others_dir, shared_base

__all__ = ["shared_base"]  # the fixture, for pytest

pytestmark = needs_other_user
COMPILER = next(filter(None, (shutil.which(c) for c in native.COMPILERS)), None)


def _mkdir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def _own(base: Path) -> tuple[Path, bool]:
    return _mkdir(base / "d"), True


def _mode(mode: int) -> Callable[[Path], tuple[Path, bool]]:
    def build(base: Path) -> tuple[Path, bool]:
        return _mkdir(base / "d", mode), not mode & 0o022

    return build


def _under(parent_mode: int, owner: int = 0) -> Callable[[Path], tuple[Path, bool]]:
    def build(base: Path) -> tuple[Path, bool]:
        parent = others_dir(base / "p", parent_mode) if owner else _mkdir(base / "p", parent_mode)
        trusted = not owner and (not parent_mode & 0o022 or bool(parent_mode & 0o1000))
        return _mkdir(parent / "d"), trusted

    return build


def _others(base: Path) -> tuple[Path, bool]:
    return others_dir(base / "d", 0o700), False


def _link_ours(base: Path) -> tuple[Path, bool]:
    _mkdir(_mkdir(base / "real", 0o755) / "d")
    (base / "l").symlink_to(base / "real")
    return base / "l" / "d", True


def _link_to_untrusted(base: Path) -> tuple[Path, bool]:
    _mkdir(others_dir(base / "p", 0o777) / "d")
    (base / "l").symlink_to(base / "p" / "d")
    return base / "l", False


def _others_link_in_sticky(base: Path) -> tuple[Path, bool]:
    _mkdir(_mkdir(base / "real", 0o755) / "d")
    sticky = _mkdir(base / "sticky", 0o1777)
    os.symlink(base / "real", sticky / "l")
    os.lchown(sticky / "l", OTHER, OTHER)
    return sticky / "l" / "d", False


def _dotdot_through_link(base: Path) -> tuple[Path, bool]:
    """``l/..`` is the link's target's parent for the kernel, ``base`` on paper."""
    _mkdir(base / "d")
    shared = others_dir(base / "p", 0o777)
    _mkdir(shared / "x")
    _mkdir(shared / "d")
    (base / "l").symlink_to(shared / "x")
    return base / "l" / ".." / "d", False


def _loop(base: Path) -> tuple[Path, bool]:
    (base / "a").symlink_to(base / "b")
    (base / "b").symlink_to(base / "a")
    return base / "a", False


TREES = {
    "own-0700": _own,
    "own-0755": _mode(0o755),
    "group-writable": _mode(0o770),
    "world-writable": _mode(0o777),
    "sticky-itself": _mode(0o1777),
    "ancestor-world-writable": _under(0o777),
    "ancestor-group-writable": _under(0o775),
    "ancestor-sticky": _under(0o1777),
    "ancestor-of-another-user": _under(0o755, OTHER),
    "ancestor-of-another-user-sticky": _under(0o1777, OTHER),
    "of-another-user": _others,
    "through-a-link-of-ours": _link_ours,
    "a-link-to-an-untrusted-place": _link_to_untrusted,
    "another-users-link-in-a-sticky-dir": _others_link_in_sticky,
    "dotdot-after-a-link": _dotdot_through_link,
    "link-loop": _loop,
}


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    if COMPILER is None:
        return None
    out = tmp_path_factory.mktemp("c") / "client"
    subprocess.run([COMPILER, "-O1", "-o", str(out), native.SOURCE], check=True)
    return out


@pytest.mark.parametrize("tree", list(TREES))
def test_python_and_the_compiled_client_apply_one_rule(
    shared_base: Path, c_client: Path | None, tree: str
) -> None:
    path, trusted = TREES[tree](shared_base)
    assert (_trust.refusal(str(path)) is None) is trusted, _trust.refusal(str(path))
    if trusted:
        fd = _trust.open_dir(str(path))
        assert fd is not None
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(path))
        finally:
            os.close(fd)
    else:
        with pytest.raises((_trust.UntrustedDirectory, OSError)):
            _trust.open_dir(str(path))
    if c_client is not None:
        rc = subprocess.run([str(c_client), "--trusted", str(path)], check=False).returncode
        assert rc == (0 if trusted else 1)


def test_a_missing_directory_is_made_private_only_under_trusted_ancestors(
    shared_base: Path,
) -> None:
    assert _trust.open_dir(str(shared_base / "new" / "kc")) is None
    assert _trust.refusal(str(shared_base / "new" / "kc")) is None
    fd = _trust.open_dir(str(shared_base / "new" / "kc"), create=True)
    assert fd is not None
    os.close(fd)
    assert (shared_base / "new" / "kc").stat().st_mode & 0o777 == 0o700
    shared = others_dir(shared_base / "shared", 0o777)
    assert _trust.refusal(str(shared / "kc")) is not None
    with pytest.raises(_trust.UntrustedDirectory, match="belongs to uid 65534"):
        _trust.open_dir(str(shared / "kc"), create=True)
    assert not (shared / "kc").exists()


def test_a_directory_a_program_runs_from_must_be_your_own(shared_base: Path) -> None:
    """Root's directories are trusted for reading; the server and client want the user's own."""
    folder = _mkdir(shared_base / "d")
    os.chown(folder, OTHER, OTHER)
    with pytest.raises(_trust.UntrustedDirectory, match="not to you"):
        _trust.open_dir(str(folder), allow_root=False)


def test_the_tiers_refuse_what_the_rule_refuses(shared_base: Path) -> None:
    from kernelcache.errors import StoreError
    from kernelcache.stores.disk import DiskStore
    from kernelcache.stores.sqlite import SQLiteStore

    shared = others_dir(shared_base / "shared", 0o777)
    disk = DiskStore(str(shared / "kc"))
    assert disk.unusable is not None
    assert "belongs to uid 65534" in disk.unusable
    sqlite = SQLiteStore(str(shared / "db" / "cache.sqlite"), open_now=False)
    with pytest.raises(StoreError, match="refusing"):
        sqlite.get("0" * 64)
    assert list(shared.iterdir()) == []  # neither made its directory there
    (shared_base / "file").write_text("")
    not_a_dir = DiskStore(str(shared_base / "file"))
    assert not_a_dir.unusable is not None
    assert "not a directory" in not_a_dir.unusable
    assert _trust.refusal(str(shared_base / "file" / "below")) is not None


def test_a_cache_walks_its_directory_once_and_keeps_its_statistics_where_it_trusts(
    shared_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernelcache import Cache, Settings

    walked: list[str] = []
    real = _trust.open_dir

    def counting(path: str, **kwargs: bool) -> int | None:
        walked.append(path)
        return real(path, **kwargs)

    # The disk tier's walk and the statistics' (refusal) both go through _trust.open_dir.
    monkeypatch.setattr(_trust, "open_dir", counting)
    own = str(_mkdir(shared_base / "own"))
    assert Cache(settings=Settings.load({}, dir=own)).stats_dir == own
    assert walked == [own]  # the disk tier's walk vouched for the statistics too
    walked.clear()
    # A read-only tier writes nothing there, so the statistics walk it themselves.
    assert Cache(settings=Settings.load({}, dir=own, read_only=True)).stats_dir == own
    assert walked == [own, own]
    walked.clear()
    shared = str(others_dir(shared_base / "shared", 0o777) / "kc")
    refused = Cache(settings=Settings.load({}, dir=shared))
    assert refused.stats_dir is None
    assert refused.tiers[1].unusable is not None
    assert walked == [shared, shared]


READER = """
import sys
from kernelcache.stores.disk import DiskStore
store = DiskStore(sys.argv[1], read_only=True)
for _ in range(2):
    entry = store.get("k" * 64)
    sys.stdout.write(entry["data"].decode() if entry is not None else "miss")
sys.stdout.write(f" hits={store.counters.hits} errors={store.counters.errors}")
"""


def test_another_user_reads_a_cache_of_roots_whose_files_refuse_o_noatime(
    shared_base: Path,
) -> None:
    """Hits open entries with O_NOATIME, which only the file's owner (or root) may ask
    for: a user reading root's read-only cache gets EPERM and reads without it."""
    import sys

    from kernelcache import Entry
    from kernelcache.stores.disk import DiskStore

    root = shared_base / "system-cache"
    DiskStore(str(root)).put("k" * 64, Entry({"data": b"from root"}))
    for folder, _dirs, files in os.walk(root):  # readable by all, writable by root only
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    setpriv = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"]
    out = subprocess.run(
        [*setpriv, sys.executable, "-c", READER, str(root)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out == "from rootfrom root hits=2 errors=0"
