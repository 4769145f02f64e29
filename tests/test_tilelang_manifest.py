"""TileLang's header manifests without a compile: which variants hold, and what is never trusted.

The fresh-process behaviour with real compiles is in ``test_tilelang.py``
(``test_header_manifest_hits_without_the_walk_and_misses_on_what_the_kernel_read``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tilelang")

from kernelcache.cache import Cache
from kernelcache.entry import Entry, private_dir
from kernelcache.integration import Counters
from kernelcache.nvcc import deps
from kernelcache.tilelang import depfile, keys, manifest, recording
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


DEVICE_ONLY_CODE = (
    '#include "top.h"\n#ifdef __CUDA_ARCH__\n#include "device_only.h"\n#else\n#include "host_only.h"\n'
    "#endif\n__global__ void k(float* x) { x[0] = A; }\n"
)


def _compile_capturing(
    tree: Path, monkeypatch: pytest.MonkeyPatch, compile_cuda: Any
) -> tuple[Entry, dict[str, Any], int, list[Any]]:
    """Compile DEVICE_ONLY_CODE through the wrapped ``compile_cuda``, as a miss does;
    the entry, its recorded call, the walk's start, and the discover() calls made."""
    for name in ("device_only.h", "host_only.h"):
        (tree / name).write_text("#define D 1\n")
    discovered: list[Any] = []
    real_discover = recording.discover

    def discover(*args: Any) -> Any:
        discovered.append(args)
        return real_discover(*args)

    monkeypatch.setattr(recording, "discover", discover)
    time.sleep(0.05)  # older than the race margin of deps.record
    started = time.time_ns()
    wrapped = recording.wrap_compile(compile_cuda)
    with recording.capturing(started=started) as calls:
        wrapped(DEVICE_ONLY_CODE, "cubin", ["-arch=sm_90"], ["-std=c++20", f"-I{tree}"])
    [call] = recording.meta(calls).values()
    entry = Entry(
        {"k.cu": DEVICE_ONLY_CODE.encode()},
        meta={manifest.CALL_META: call, "device_source": "k.cu"},
    )
    return entry, call, started, discovered


def _recorded(cache: Cache) -> set[str]:
    [variant] = json.loads(cache.get(PRE)[deps.MANIFEST])  # type: ignore[index]
    return {row[0] for row in variant["deps"]}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_compile_itself_writes_what_it_read(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: a miss records its manifest from the compile's own device preprocessor
    run (GCC's -MD through -Xcompiler), with no second preprocessor run; what it lists is
    what discover()'s -M run lists, device-only headers in, host-only ones out."""
    import tilelang.contrib.nvcc as tl_nvcc

    left = set(os.listdir(private_dir()))  # by earlier tests in this process, if any
    entry, call, started, discovered = _compile_capturing(tree, monkeypatch, tl_nvcc.compile_cuda)
    assert len(set(os.listdir(private_dir())) - left) == 1  # the compile wrote its file
    cache = Cache()
    assert recording.record(cache, PRE, RESULT, entry, call, started)
    assert discovered == []  # no preprocessor run but the compile's own
    expected = {str(tree / name) for name in ("top.h", "cuda/common.h", "device_only.h")}
    assert _recorded(cache) == expected
    by_m = manifest.tree_files(recording.discover(DEVICE_ONLY_CODE, call) or [], [str(tree)])
    assert set(by_m or []) == expected  # the -M run agrees
    assert set(os.listdir(private_dir())) == left  # read, then removed
    (tree / "device_only.h").write_text("#define D 2\n")
    assert _find(cache) == (None, 0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_flags_leave_nvccs_output_unchanged(tree: Path, tmp_path: Path) -> None:
    """TileLang's nvcc command line (tilelang/contrib/nvcc.py, 0.1.15), run in one
    folder with and without the dependency flags: the same cubin, byte for byte."""
    from tilelang.contrib.cc import get_cplus_compiler

    (tree / "device_only.h").write_text("#define D 1\n")
    (tree / "host_only.h").write_text("#define H 1\n")
    (tmp_path / "tvm_kernels.cu").write_text(DEVICE_ONLY_CODE)
    host = get_cplus_compiler()
    options = ["-std=c++20", f"-I{tree}"]
    written = depfile.flags("cubin", options, host, {})
    assert written is not None
    outputs = []
    for extra in ([], written[0]):
        argv = ["nvcc", f"-ccbin={host}", "--cubin", "-O3", "-lineinfo", "-arch=sm_90"]
        argv += [*options, *extra, "-o", "out.cubin", "tvm_kernels.cu"]
        subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True)
        outputs.append((tmp_path / "out.cubin").read_bytes())
    assert outputs[0] == outputs[1]
    assert str(tree / "device_only.h") in (depfile.read(written[1]) or [])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_without_the_compiles_file_the_preprocessor_runs_again(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile that was to write its dependency file and did not (a host compiler
    that ignored the flags): the manifest comes from discover(), as before."""
    import tilelang.contrib.nvcc as tl_nvcc

    def drops_the_flags(code: str, fmt: str, arch: Any, options: Any, *rest: Any) -> Any:
        kept = [o for o in options if not o.startswith("-MD,") and o != "-Xcompiler"]
        return tl_nvcc.compile_cuda(code, fmt, arch, kept, *rest)

    entry, call, started, discovered = _compile_capturing(tree, monkeypatch, drops_the_flags)
    cache = Cache()
    assert recording.record(cache, PRE, RESULT, entry, call, started)
    assert len(discovered) == 1
    assert _recorded(cache) == {
        str(tree / name) for name in ("top.h", "cuda/common.h", "device_only.h")
    }


@pytest.mark.parametrize(
    ("fmt", "options", "host", "env", "asked"),
    [
        ("cubin", ["-std=c++20"], "/usr/bin/g++", {}, True),
        ("ptx", [], "x86_64-linux-gnu-g++-12", {}, True),
        ("cubin", [], "/opt/llvm/bin/clang++-17", {"NVCC_APPEND_FLAGS": "-lineinfo"}, True),
        ("fatbin", [], "g++", {}, False),  # a preprocessor run per architecture, one file
        ("cubin", ["-MD"], "g++", {}, False),  # the call asks for dependencies itself
        ("cubin", ["--generate-dependencies-with-compile"], "g++", {}, False),
        ("cubin", ["-Xcompiler=-MMD"], "g++", {}, False),
        ("cubin", [], "g++", {"NVCC_APPEND_FLAGS": "-MD"}, False),  # nvcc's own pass: a 2nd writer
        ("cubin", ["-gencode=arch=compute_80,code=sm_80"], "g++", {}, False),  # a 2nd device run
        ("cubin", [], "g++", {"NVCC_PREPEND_FLAGS": "-arch=sm_80"}, False),
        ("cubin", [], "icpx", {}, False),  # a host compiler not known to take -MD -MF
        ("cubin", [], None, {}, False),
    ],
)
def test_where_the_compile_is_asked_to_write_what_it_read(
    fmt: str, options: list[str], host: str | None, env: dict[str, str], asked: bool
) -> None:
    written = depfile.flags(fmt, options, host, env)
    assert (written is not None) == asked
    if written is not None:
        assert written[0] == ["-Xcompiler", f"-MD,-MF,{written[1]}"]
        assert os.path.dirname(written[1]) == private_dir()
