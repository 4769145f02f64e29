"""TileLang's header manifests without a compile: which variants hold, and what is never trusted.

The fresh-process behaviour with real compiles is in ``test_tilelang.py``
(``test_header_manifest_hits_without_the_walk_and_misses_on_what_the_kernel_read``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tilelang")

from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.integration import Counters
from kernelcache.nvcc import deps
from kernelcache.tilelang import keys, manifest, recording
from kernelcache.tilelang.kernels import COUNTERS
from tilelang_tree import header_tree

PRE = "cd" * 32
RESULT = "ab" * 32


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A header tree standing in for TileLang's, and a cache directory."""
    folder = header_tree(tmp_path, monkeypatch)
    (folder / "other.h").write_text("#define B 1\n")
    monkeypatch.setattr(keys, "header_folders", lambda: {"templates": str(folder), "cutlass": None})
    return folder


def _put(cache: Cache, variants: Any) -> None:
    payload = variants if isinstance(variants, bytes) else json.dumps(variants).encode()
    cache.put(PRE, Entry({deps.MANIFEST: payload}))


def _find(cache: Cache) -> tuple[str | None, int]:
    counters = Counters(COUNTERS)
    return manifest.find(cache, PRE, counters), counters.snapshot()["bad_manifests"]


def test_a_variant_holds_while_what_the_compile_read_holds(tree: Path) -> None:
    time.sleep(0.05)  # older than the race margin of deps.record
    started = time.time_ns()
    recorded = deps.record([str(tree / "top.h"), str(tree / "cuda" / "common.h")], None, started)
    dirs = recording.watch([str(tree)], started)
    assert recorded is not None
    assert dirs is not None
    cache = Cache()
    _put(cache, deps.add_variant([], recorded[0], dirs, RESULT))
    assert _find(cache) == (RESULT, 0)
    # A file the compile did not read, edited in place: the variant still holds.
    (tree / "other.h").write_text("#define B 2\n")
    assert _find(cache) == (RESULT, 0)
    # A new file anywhere under the tree (it could shadow an include): it does not.
    (tree / "cuda" / "top.h").write_text("\n")
    assert _find(cache) == (None, 0)
    (tree / "cuda" / "top.h").unlink()
    assert _find(cache) == (RESULT, 0)
    # A file the compile read, edited: it does not.
    (tree / "cuda" / "common.h").write_text("#define A 2\n")
    assert _find(cache) == (None, 0)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"[" * 100_000, id="too-deep"),
        pytest.param({"deps": []}, id="not-a-list"),
        pytest.param(["variant"], id="not-a-dict"),
        pytest.param([{"deps": "x", "absent": [], "result": RESULT}], id="wrong-types"),
        pytest.param([{"deps": [], "absent": [], "result": "../x"}], id="result-not-a-key"),
        pytest.param(
            [{"deps": [["/etc/passwd", "0" * 64, None]], "absent": [], "result": RESULT}],
            id="file-outside-the-trees",
        ),
        pytest.param(
            [{"deps": [["HEADERS/../../x", "0" * 64, None]], "absent": [], "result": RESULT}],
            id="dotdot-out-of-the-trees",
        ),
        pytest.param(
            [{"deps": [["HEADERS/top.h", "0" * 64, [1, 2]]], "absent": [], "result": RESULT}],
            id="bad-signature",
        ),
        pytest.param(
            [{"deps": [], "absent": [["/", None, "x"]], "result": RESULT}],
            id="directory-outside-the-trees",
        ),
    ],
)
def test_a_damaged_or_foreign_manifest_is_skipped_and_counted(tree: Path, payload: Any) -> None:
    if not isinstance(payload, bytes):
        payload = json.loads(json.dumps(payload).replace("HEADERS", str(tree)))
    cache = Cache()
    _put(cache, payload)
    assert _find(cache) == (None, 1)


def test_a_manifest_without_its_artifact_is_skipped_and_counted(tree: Path) -> None:
    cache = Cache()
    cache.put(PRE, Entry({"other": b"x"}))
    assert _find(cache) == (None, 1)


def _later(monkeypatch: pytest.MonkeyPatch, compiled: bool, age_ns: int) -> list[Any]:
    """The manifests record_later() recorded (``record`` stubbed: no nvcc)."""
    recorded: list[Any] = []
    monkeypatch.setattr(recording, "RECORDING", [])
    monkeypatch.setattr(recording, "record", lambda *args: recorded.append(args))
    call: dict[str, Any] = {"format": "cubin", "arch": [], "options": [], "code": "c" * 64}
    call["compiled_ns"] = time.time_ns() - age_ns
    entry = Entry({"k.cu": b"x"}, meta={manifest.CALL_META: call, "device_source": "k.cu"})
    recording.record_later(Cache(), PRE, RESULT, entry, time.time_ns(), compiled=compiled)
    recording.wait()
    return recorded


def test_who_records_a_manifest(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiling process; a process that found an older entry by the walk; not the
    processes that waited for a fresh compile (its compiler records it)."""
    assert len(_later(monkeypatch, compiled=True, age_ns=0)) == 1
    assert len(_later(monkeypatch, compiled=False, age_ns=2 * recording.FRESH_NS)) == 1
    assert _later(monkeypatch, compiled=False, age_ns=0) == []
    monkeypatch.setenv("KERNELCACHE_READONLY", "1")
    assert _later(monkeypatch, compiled=True, age_ns=0) == []


def test_only_one_known_nvcc_call_is_kept_as_meta() -> None:
    call = recording.describe_call("code", "cubin", ["-arch=sm_90"], "-std=c++20")
    assert call is not None
    assert call["options"] == ["-std=c++20"]
    assert recording.meta([call])[manifest.CALL_META] == {
        **call,
        "compiled_ns": pytest.approx(time.time_ns(), abs=10**10),
    }
    assert recording.meta([call, call]) == {}  # two compiles: which one did the kernel use?
    assert (
        recording.describe_call("code", "cubin", None, []) is None
    )  # arch from the current target
    assert recording.meta([None]) == {}


def test_a_header_linked_out_of_the_trees_keeps_the_kernel_off_the_manifest(
    tree: Path, tmp_path: Path
) -> None:
    """Recorded paths are real paths under the trees: a file read through a link that
    leaves them would go unchecked, so no manifest is recorded for that compile."""
    (tmp_path / "outside.h").write_text("\n")
    (tree / "linked.h").symlink_to(tmp_path / "outside.h")
    roots = [str(tree)]
    inside = [str(tree / "cuda" / ".." / "top.h"), "/usr/include/stdio.h"]
    assert manifest.tree_files(inside, roots) == [str(tree / "top.h")]
    assert manifest.tree_files([*inside, str(tree / "linked.h")], roots) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (its preprocessor runs)")
def test_recorded_from_nvccs_device_preprocessor(tree: Path) -> None:
    """What the compile read comes from nvcc's own device preprocessor runs: a header
    included only under ``__CUDA_ARCH__`` is recorded, and an edit of it misses."""
    (tree / "device_only.h").write_text("#define D 1\n")
    code = (
        '#include "top.h"\n#ifdef __CUDA_ARCH__\n#include "device_only.h"\n#endif\n'
        "__global__ void k(float* x) { x[0] = A; }\n"
    )
    call = recording.describe_call(code, "cubin", ["-arch=sm_90"], ["-std=c++20", f"-I{tree}"])
    [recorded_call] = recording.meta([call]).values()
    entry = Entry(
        {"k.cu": code.encode()}, meta={manifest.CALL_META: recorded_call, "device_source": "k.cu"}
    )
    time.sleep(0.05)  # older than the race margin of deps.record
    cache = Cache()
    assert recording.record(cache, PRE, RESULT, entry, recorded_call, time.time_ns())
    assert _find(cache) == (RESULT, 0)
    [variant] = json.loads(cache.get(PRE)[deps.MANIFEST])  # type: ignore[index]
    assert {row[0] for row in variant["deps"]} == {
        str(tree / name) for name in ("top.h", "cuda/common.h", "device_only.h")
    }
    (tree / "device_only.h").write_text("#define D 2\n")
    assert _find(cache) == (None, 0)
