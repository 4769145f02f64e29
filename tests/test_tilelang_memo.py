"""TileLang's header-tree memo: used while the trees' stats hold, trusted only in a trusted
directory under trusted ancestors (``kernelcache._memos``, the one trust rule), never written
read-only (issue 19 item 8), and the key's shared fields derived once."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tilelang")

from kernelcache import _memos
from kernelcache.tilelang import keys, trees
from tilelang_tree import header_tree

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small header tree older than the timestamp granularity, and a cache directory for it."""
    folder = header_tree(tmp_path, monkeypatch)
    _age()
    return folder


def _age() -> None:
    """Let the tree's stats grow older than the timestamp granularity (``_fs.TOO_NEW_NS``):
    only then do they vouch for its content (ctime cannot be set back)."""
    time.sleep(2.1)


def _memo_file(tmp_path: Path) -> Path:
    return tmp_path / "kc" / trees.TREE_MEMO


def _plant(memo_file: Path, folder: Path, digest: str) -> None:
    memo = json.loads(memo_file.read_text())
    memo["trees"][str(folder)]["digest"] = digest
    memo_file.write_text(json.dumps(memo))


def test_memo_is_used_only_while_stats_are_unchanged(tree: Path, tmp_path: Path) -> None:
    first = trees.tree_fingerprint(str(tree))
    memo_file = _memo_file(tmp_path)
    assert json.loads(memo_file.read_text())["trees"][str(tree)]["digest"] == first
    # The memo answers while every stat is unchanged (proved by planting a marker)...
    _plant(memo_file, tree, "planted")
    assert trees.tree_fingerprint(str(tree)) == "planted"
    # ...an edit of the same size changes the stat signature: re-hashed from content...
    (tree / "cuda" / "common.h").write_text("#define A 2\n")
    assert trees.tree_fingerprint(str(tree)) not in ("planted", first)
    # ...and so does a new file.
    (tree / "new.h").write_text("\n")
    assert trees.tree_fingerprint(str(tree)) not in ("planted", first)


def test_fingerprint_is_by_content_and_relative_name_not_location(
    tree: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "elsewhere" / "headers"
    copy.parent.mkdir()
    os.rename(tree, copy)
    moved = trees.tree_fingerprint(str(copy))
    os.rename(copy, tree)
    assert trees.tree_fingerprint(str(tree)) == moved


@pytest.mark.parametrize(
    "refusal",
    [
        pytest.param("group-writable", id="mode-0770"),
        pytest.param("world-writable", id="mode-0777"),
        pytest.param("foreign-owner", id="owned-by-nobody"),
    ],
)
def test_memo_in_a_refused_directory_is_neither_read_nor_written(
    tree: Path, tmp_path: Path, refusal: str
) -> None:
    honest = trees.tree_fingerprint(str(tree))
    memo_file = _memo_file(tmp_path)
    _plant(memo_file, tree, "forged")  # what another user could write there
    folder = memo_file.parent
    if refusal == "group-writable":
        folder.chmod(0o770)
    elif refusal == "world-writable":
        folder.chmod(0o777)
    else:
        os.chown(folder, 65534, 65534)
    before, listed = memo_file.read_bytes(), sorted(os.listdir(folder))
    assert trees.tree_fingerprint(str(tree)) == honest  # the forged memo is not believed
    (tree / "top.h").write_text('#include "cuda/common.h"\n// edited\n')
    _age()  # old enough to be memoised, if the directory were trusted
    assert trees.tree_fingerprint(str(tree)) not in (honest, "forged")
    assert memo_file.read_bytes() == before  # nothing written into the refused directory
    assert sorted(os.listdir(folder)) == listed  # no lock file either


def test_memo_file_of_another_user_or_a_link_is_not_read(tree: Path, tmp_path: Path) -> None:
    honest = trees.tree_fingerprint(str(tree))
    memo_file = _memo_file(tmp_path)
    _plant(memo_file, tree, "forged")
    os.chown(memo_file, 65534, 65534)
    assert trees.tree_fingerprint(str(tree)) == honest
    os.chown(memo_file, os.geteuid(), os.getegid())
    memo_file.chmod(0o666)
    assert trees.tree_fingerprint(str(tree)) == honest
    memo_file.chmod(0o600)
    elsewhere = tmp_path / "planted.json"
    os.rename(memo_file, elsewhere)
    memo_file.symlink_to(elsewhere)
    assert trees.tree_fingerprint(str(tree)) == honest


def test_read_only_writes_nothing(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELCACHE_READONLY", "1")
    trees.tree_fingerprint(str(tree))
    assert not (tmp_path / "kc").exists()  # not even the directory
    monkeypatch.setenv("KERNELCACHE_READONLY", "0")
    trees.tree_fingerprint(str(tree))
    assert _memo_file(tmp_path).is_file()
    # A read-only process still uses a memo that is there.
    _plant(_memo_file(tmp_path), tree, "planted")
    monkeypatch.setenv("KERNELCACHE_READONLY", "yes")
    before = _memo_file(tmp_path).read_bytes()
    assert trees.tree_fingerprint(str(tree)) == "planted"
    (tree / "top.h").write_text("// changed\n")
    trees.tree_fingerprint(str(tree))
    assert _memo_file(tmp_path).read_bytes() == before


def test_read_only_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which KERNELCACHE_READONLY values keep memos (and their locks) from being written."""
    for i, (text, read_only) in enumerate([("", False), ("0", False), ("off", False), (" No ", False),
                           ("1", True), ("true", True), ("on", True), ("bogus", True)]):  # fmt: skip
        monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / f"kc{i}"))
        monkeypatch.setenv("KERNELCACHE_READONLY", text)
        with _memos.exclusive("m.json") as locked:
            assert locked is not read_only, text
        assert _memos.save("m.json", {"a": 1}) is not read_only, text
        assert (tmp_path / f"kc{i}").exists() is not read_only, text  # not even the directory


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A folder the second user can reach (pytest's own tmp root is private to us)."""
    folder = Path(tempfile.mkdtemp(prefix="kernelcache-memo-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_another_user_cannot_plant_a_memo_through_a_shared_directory(public_dir: Path) -> None:
    """A second local user with write access to a 0777 cache directory: the memo there is ignored."""
    shared = public_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    planted = shared / trees.TREE_MEMO
    forged = {"version": 2, "trees": {"/x": {"sig": "s", "digest": "forged"}}}
    code = f"import json; open({str(planted)!r}, 'w').write({json.dumps(forged)!r})"
    subprocess.run([*NOBODY, sys.executable, "-c", code], check=True)
    assert planted.stat().st_uid == 65534
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KERNELCACHE_DIR", str(shared))
        env.delenv("KERNELCACHE_READONLY", raising=False)
        assert _memos.load(trees.TREE_MEMO) == {}
        assert _memos.save("other.json", {"a": 1}) is False
        with _memos.exclusive("other.json") as locked:
            assert not locked
    assert sorted(os.listdir(shared)) == [trees.TREE_MEMO]  # no memo, no lock file


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=["world-writable", "group-writable"])
def test_an_ancestor_writable_by_others_refuses_the_memo(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """The cache directory is ours and private, but its parent is not: whoever can write the
    parent can swap the directory for theirs between check and use. The memo there is neither
    read nor written (a check of the directory alone accepted it)."""
    honest = trees.tree_fingerprint(str(tree))
    memo_file = _memo_file(tmp_path)
    _plant(memo_file, tree, "forged")
    parent = tmp_path / "open"
    parent.mkdir()
    os.rename(memo_file.parent, parent / "kc")
    memo_file = parent / "kc" / trees.TREE_MEMO
    monkeypatch.setenv("KERNELCACHE_DIR", str(parent / "kc"))
    assert trees.tree_fingerprint(str(tree)) == "forged"  # trusted while the parent is private
    parent.chmod(mode)  # not sticky: others may rename entries they do not own
    before, listed = memo_file.read_bytes(), sorted(os.listdir(memo_file.parent))
    assert _memos.load(trees.TREE_MEMO) == {}
    assert trees.tree_fingerprint(str(tree)) == honest  # the planted memo is not believed
    (tree / "top.h").write_text('#include "cuda/common.h"\n// edited\n')
    _age()
    assert trees.tree_fingerprint(str(tree)) not in (honest, "forged")
    assert _memos.save("other.json", {"a": 1}) is False
    assert memo_file.read_bytes() == before  # nothing written under the open parent
    assert sorted(os.listdir(memo_file.parent)) == listed  # no lock file either


def test_shared_fields_are_hashed_once_per_process(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """install() starts deriving them in the background; kernel_key waits for that work
    and reuses it instead of hashing again."""
    from kernelcache import fingerprint

    hashed: list[str] = []
    real = fingerprint.files
    monkeypatch.setattr(keys, "_warming", [])
    monkeypatch.setattr(keys, "_prefetched", False)
    monkeypatch.setattr(keys, "_tree", functools.cache(trees.tree_fingerprint))
    monkeypatch.setattr(
        keys,
        "headers_folder",
        lambda label: str(tree / "cuda") if label == "templates" else str(tree),
    )

    def files(paths: list[str], root: str) -> str:
        hashed.append(root)
        return real(paths, root)

    monkeypatch.setattr(fingerprint, "files", files)
    keys.prefetch()
    keys.prefetch()
    first = keys.kernel_key("u" * 64, "tvm_ffi", "cuda")
    assert keys.kernel_key("u" * 64, "tvm_ffi", "cuda") == first
    assert sorted(hashed) == sorted([str(tree), str(tree / "cuda")])


def test_a_warm_memo_starts_no_background_thread(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: with both trees in the memo, prefetch starts nothing (a thread would
    only take the GIL from the user's code at a fresh-process hit); with one missing,
    it starts a walk per missing tree and the compilers' probes."""
    started: list[object] = []
    monkeypatch.setattr(keys, "_warming", started)
    monkeypatch.setattr(keys, "_prefetched", False)
    monkeypatch.setattr(keys, "_tree", functools.cache(trees.tree_fingerprint))
    monkeypatch.setattr(
        keys,
        "headers_folder",
        lambda label: str(tree / "cuda") if label == "templates" else str(tree),
    )
    keys.prefetch()
    assert len(started) == 3  # two trees, then the libraries and compilers
    first = keys.kernel_key("u" * 64, "tvm_ffi", "cuda")
    started = []
    monkeypatch.setattr(keys, "_warming", started)
    monkeypatch.setattr(keys, "_prefetched", False)
    monkeypatch.setattr(keys, "_tree", functools.cache(trees.tree_fingerprint))
    keys.prefetch()
    assert started == []
    assert keys.kernel_key("u" * 64, "tvm_ffi", "cuda") == first
    # Decided once per process: the next keys do not read the memo again to decide.
    asked: list[str] = []
    real_memoised = keys._memoised  # noqa: SLF001

    def memoised(label: str) -> bool:
        asked.append(label)
        return False

    monkeypatch.setattr(keys, "_memoised", memoised)
    keys.prefetch()
    assert (started, asked) == ([], [])
    monkeypatch.setattr(keys, "_memoised", real_memoised)
    (tree / "cuda" / "new.h").write_text("#define B 2\n")  # one tree's memo no longer holds
    monkeypatch.setattr(keys, "_warming", [])
    monkeypatch.setattr(keys, "_prefetched", False)
    monkeypatch.setattr(keys, "_tree", functools.cache(trees.tree_fingerprint))
    keys.prefetch()
    assert keys.kernel_key("u" * 64, "tvm_ffi", "cuda") != first


CHILD = """
import json, sys
import children
from kernelcache.tilelang import trees
children.wait_for(sys.argv[2])
digest = trees.tree_fingerprint(sys.argv[1])
print(json.dumps({"digest": digest, "hashed": len(trees.HASHED)}))
"""


def test_processes_missing_the_memo_at_once_hash_the_tree_once(tree: Path, tmp_path: Path) -> None:
    """Issue 23: N processes started together on an empty memo wait for one hash, not N."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here)])}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tree), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    go.touch()
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert len({r["digest"] for r in reports}) == 1
    assert sum(r["hashed"] for r in reports) == 1


def test_a_failure_in_the_background_is_raised_by_kernel_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe that fails in a prefetch thread is derived again in the caller, and raises there."""

    def unreadable() -> dict[str, str]:
        raise PermissionError("header tree unreadable")

    monkeypatch.setattr(keys, "_warming", [])
    monkeypatch.setattr(keys, "_prefetched", False)
    monkeypatch.setattr(keys, "headers", unreadable)
    monkeypatch.setattr(keys, "_header_tree", lambda label: unreadable())
    monkeypatch.setattr(keys, "library_stamp", dict)
    monkeypatch.setattr(keys, "compilers", lambda backend: {})
    keys.prefetch()
    with pytest.raises(PermissionError, match="unreadable"):
        keys.kernel_key("u" * 64, "tvm_ffi", "cuda")
