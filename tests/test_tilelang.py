"""kernelcache as TileLang's cache, with the real TileLang package and real nvcc compiles.

Compiles run in processes of their own (``tilelang_kernels.py``) under a
stand-in CUDA toolkit whose nvcc counts its runs (``cuda_standin.py``); no GPU
is needed: the targets name an architecture (sm_90, sm_90a for the GEMM).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

tilelang = pytest.importorskip("tilelang")

import children  # noqa: E402
from cuda_standin import Toolkit, make_toolkit  # noqa: E402
from disk_entries import stored_keys  # noqa: E402
from kernelcache.tilelang import keys  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "tilelang_kernels.py"
ROOT = HERE.parent
JIT_KERNEL = "tilelang.jit.kernel.JITKernel"
ADAPTERS = {
    "tvm_ffi": "tilelang.jit.adapter.tvm_ffi.TVMFFIKernelAdapter",
    "cython": "tilelang.jit.adapter.cython.adapter.CythonKernelAdapter",
}


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory: pytest.TempPathFactory) -> Toolkit:
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        pytest.skip("needs nvcc (the compiles are real)")
    return make_toolkit(tmp_path_factory.mktemp("standin"))


@pytest.fixture
def dsl_env(toolkit: Toolkit, tmp_path: Path) -> dict[str, str]:
    """A fresh kernelcache and TileLang cache directory per test, the stand-in nvcc."""
    toolkit.reset()
    env = toolkit.env()
    env["KERNELCACHE_DIR"] = str(tmp_path / "kc")
    env["TILELANG_CACHE_DIR"] = str(tmp_path / "tilelang")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE)])
    env.pop("TILELANG_DISABLE_CACHE", None)
    return env


def run(env: dict[str, str], *args: str) -> dict[str, Any]:
    return children.finish(children.start(SCRIPT, env, *args))


@pytest.mark.parametrize(
    ("kernel", "backend"),
    [
        pytest.param("add", "tvm_ffi", id="add-sm_90-tvm_ffi"),
        pytest.param("gemm", "tvm_ffi", id="gemm-sm_90a-tvm_ffi"),
        pytest.param("add", "cython", id="add-sm_90-cython"),
    ],
)
def test_compiled_once_then_hit_in_a_fresh_process_without_nvcc(
    toolkit: Toolkit, dsl_env: dict[str, str], kernel: str, backend: str
) -> None:
    first = run(dsl_env, kernel, backend)
    assert first["stats"]["misses"] == 1
    assert first["stats"]["compiles"] == 1
    assert len(toolkit.compiles()) == 1
    runs_before = len(toolkit.runs())

    second = run(dsl_env, kernel, backend)
    assert second["stats"] == {**second["stats"], "hits": 1, "misses": 0, "compiles": 0}
    assert len(toolkit.runs()) == runs_before, "a hit must not run nvcc at all"
    # The object upstream returns: TileLang's JITKernel over the backend's own adapter.
    for report in (first, second):
        assert report["kernel_class"] == JIT_KERNEL
        assert report["adapter_class"] == ADAPTERS[backend]
    assert second["source_chars"] == first["source_chars"] > 0
    entries = stored_keys(dsl_env["KERNELCACHE_DIR"])
    # One compiled kernel is ONE entry; tvm_ffi's has its header manifest and its device
    # binary (kernelcache.tilelang.binaries) beside it.
    assert len(entries) == (3 if backend == "tvm_ffi" else 1)
    # TileLang's own kernel cache stayed empty: kernelcache took its place.
    assert not list(Path(dsl_env["TILELANG_CACHE_DIR"]).rglob("*.so"))


def _start_together(
    env: dict[str, str], tmp_path: Path, count: int, *args: str
) -> list[dict[str, Any]]:
    go = tmp_path / "go"
    procs = [children.start(SCRIPT, env, *args, "--wait-for", str(go)) for _ in range(count)]
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("go.ready.*"))) < count:
        assert time.monotonic() < deadline, "workers never got ready"
        assert all(p.poll() is None for p in procs), [
            children.finish(p) for p in procs if p.poll() is not None
        ]
        time.sleep(0.05)
    go.touch()
    return [children.finish(p) for p in procs]


def test_two_processes_started_together_run_nvcc_once(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    reports = _start_together(dsl_env, tmp_path, 2, "add", "tvm_ffi")
    assert len(toolkit.compiles()) == 1
    assert sorted(r["stats"]["compiles"] for r in reports) == [0, 1]
    assert sorted(r["stats"]["hits"] for r in reports) == [0, 1]


def test_the_compiling_caller_gets_its_kernel_before_the_entry_is_published(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 23: TileLang's writers link the library again (~0.2 s of a ~1.4 s compile);
    the caller that compiled does not wait for them, the entry is published after its
    kernel is handed back. A process asking meanwhile waits for that entry."""
    gate = tmp_path / "publish"
    leader = children.start(SCRIPT, dsl_env, "add", "tvm_ffi", "--publish-gate", str(gate))
    returned = Path(f"{gate}.returned")
    deadline = time.monotonic() + 120
    while not returned.exists():
        assert time.monotonic() < deadline, "the compile call waited for the entry's publishing"
        assert leader.poll() is None, children.finish(leader)
        time.sleep(0.05)
    # Handed back with the kernel's own entry unpublished: only nvcc's output (binaries) is in.
    assert json.loads(returned.read_text()) == {"entries": 1}
    go = tmp_path / "go"
    waiter = children.start(SCRIPT, dsl_env, "add", "tvm_ffi", "--wait-for", str(go))
    while not list(tmp_path.glob("go.ready.*")):
        assert time.monotonic() < deadline + 120, "the waiter never got ready"
        assert waiter.poll() is None, children.finish(waiter)
        time.sleep(0.05)
    go.touch()
    time.sleep(1.0)
    assert waiter.poll() is None, "the waiter must wait for the leader's entry"
    gate.touch()
    first, second = children.finish(leader), children.finish(waiter)
    assert first["stats"] == {**first["stats"], "compiles": 1, "unpublished": 0}
    assert second["stats"] == {**second["stats"], "hits": 1, "compiles": 0}
    assert len(toolkit.compiles()) == 1
    assert len(stored_keys(dsl_env["KERNELCACHE_DIR"])) == 3


@pytest.mark.slow
def test_a_first_run_decides_the_key_before_code_generation(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 23: while the key's fields are still being derived, TileLang lowers the
    kernel; the key is looked up before the device code generation. An entry found
    there ends the compile before nvcc; a free key is compiled once, however many
    processes start together."""
    reports = _start_together(dsl_env, tmp_path, 2, "add", "tvm_ffi", "--first-run")
    assert len(toolkit.compiles()) == 1
    assert sorted(r["stats"]["compiles"] for r in reports) == [0, 1]
    assert sorted(r["stats"]["hits"] for r in reports) == [0, 1]
    runs_before = len(toolkit.runs())
    again = run(dsl_env, "add", "tvm_ffi", "--first-run")
    assert again["stats"] == {**again["stats"], "hits": 1, "misses": 0, "compiles": 0}
    assert again["stats"]["manifest_hits"] == 1
    assert len(toolkit.runs()) == runs_before, "an entry found must end the compile before nvcc"
    assert again["source_chars"] == reports[0]["source_chars"] > 0
    assert again["adapter_class"] == ADAPTERS["tvm_ffi"]
    # Without its manifest, a first run finds the entry by the walk and records it again.
    _manifests(dsl_env, delete=True)
    walked = run(dsl_env, "add", "tvm_ffi", "--first-run", "--record-fresh")
    assert walked["stats"] == {**walked["stats"], "hits": 1, "compiles": 0, "manifest_hits": 0}
    assert _manifests(dsl_env), "the walk's hit records the manifest for the next process"
    assert run(dsl_env, "add", "tvm_ffi", "--first-run")["stats"]["manifest_hits"] == 1
    assert len(toolkit.runs()) > runs_before  # the recording's preprocessor runs, not a compile
    assert len(toolkit.compiles()) == 1


def test_a_failed_lookup_in_a_first_run_raises_as_itself(
    toolkit: Toolkit, dsl_env: dict[str, str]
) -> None:
    """Not as the RuntimeError TVM's FFI would make of it, and before nvcc runs."""
    proc = children.start(SCRIPT, dsl_env, "add", "tvm_ffi", "--first-run", "--lookup-fails")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "PermissionError: planted" in err
    assert toolkit.compiles() == []


def test_upstream_cache_compiles_once_per_process(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    # What kernelcache fixes: TileLang's own cache lets both processes run nvcc.
    upstream = _start_together(dsl_env, tmp_path, 2, "add", "tvm_ffi", "--upstream")
    assert len(toolkit.compiles()) == 2
    # kernelcache hands back the kind of object upstream returns.
    ours = run(dsl_env, "add", "tvm_ffi")
    assert {(r["kernel_class"], r["adapter_class"]) for r in upstream} == {
        (ours["kernel_class"], ours["adapter_class"])
    }


def test_eviction_is_a_miss_not_a_crash(toolkit: Toolkit, dsl_env: dict[str, str]) -> None:
    run(dsl_env, "add", "tvm_ffi")
    # Evicted between this process's lookup and its load (another process pruned it):
    # the verified bytes in hand still load; a loader failure would be a counted miss.
    report = run(dsl_env, "add", "tvm_ffi", "--evict-after-get")
    assert report["stats"]["hits"] + report["stats"]["unusable_entries"] == 1
    assert report["adapter_class"] == ADAPTERS["tvm_ffi"]
    # Evicted before the lookup, files and all: a miss that compiles again.
    shutil.rmtree(Path(dsl_env["KERNELCACHE_DIR"]) / "v1")
    again = run(dsl_env, "add", "tvm_ffi")
    assert again["stats"]["misses"] == 1
    assert again["stats"]["compiles"] == 1
    assert len(toolkit.compiles()) == 2


def test_an_entry_whose_library_will_not_load_is_replaced(
    toolkit: Toolkit, dsl_env: dict[str, str]
) -> None:
    from kernelcache.cache import Cache
    from kernelcache.entry import Entry
    from kernelcache.stores.disk import DiskStore

    run(dsl_env, "add", "tvm_ffi")
    # Verified bytes that are not a loadable library (a foreign or mis-built entry).
    with Cache([DiskStore(dsl_env["KERNELCACHE_DIR"])], persist_stats=False) as cache:
        # The kernel's entry (its header manifest and its device binary are the others).
        stored = list(cache.tiers[0].keys())
        [(key, entry)] = [(k, e) for k in stored if (e := cache.get(k)) and "library" in e.meta]
        library = entry.meta["library"]
        cache.put(key, Entry({**entry, library: b"not a shared library"}, meta=entry.meta))
    damaged = run(dsl_env, "add", "tvm_ffi")
    assert damaged["stats"]["unusable_entries"] == 1
    assert damaged["stats"]["compiles"] == 1
    # Rebuilt around the device binary's own entry (its bytes verified): no nvcc run.
    assert damaged["stats"]["binary_hits"] == 1
    assert len(toolkit.compiles()) == 1
    healed = run(dsl_env, "add", "tvm_ffi")
    assert healed["stats"]["hits"] == 1
    assert len(toolkit.compiles()) == 1


def test_template_headers_key_by_content_not_path(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    folder = keys.headers_folder("templates")
    assert folder is not None  # TileLang ships its templates
    templates = Path(folder)
    copies = [tmp_path / "a" / "src", tmp_path / "b" / "src"]
    for copy in copies:
        shutil.copytree(templates, copy)
    run({**dsl_env, "TL_TEMPLATE_PATH": str(copies[0])}, "add", "tvm_ffi")
    assert len(toolkit.compiles()) == 1
    # Same headers at another path: the same key, a hit without nvcc.
    moved = run({**dsl_env, "TL_TEMPLATE_PATH": str(copies[1])}, "add", "tvm_ffi")
    assert moved["stats"]["hits"] == 1
    assert len(toolkit.compiles()) == 1
    # An edited header: a miss, and nvcc really runs again.
    header = copies[1] / "tl_templates" / "cuda" / "common.h"  # one the kernel includes
    header.write_text(header.read_text() + "\n// edited\n")
    edited = run({**dsl_env, "TL_TEMPLATE_PATH": str(copies[1])}, "add", "tvm_ffi")
    assert edited["stats"]["misses"] == 1
    assert len(toolkit.compiles()) == 2


def test_kernels_of_one_device_code_share_one_nvcc_run(
    toolkit: Toolkit, dsl_env: dict[str, str]
) -> None:
    """Add kernels whose sizes change only the launch grid have the same device code:
    TileLang's binary cache ran nvcc once for them, and kernelcache, which replaces that
    cache, does too (issue 23). Each kernel is still an entry of its own, whose
    fresh-process hit goes through its header manifest. NVCC_APPEND_FLAGS reaches nvcc
    without changing its command line: neither the kernel nor its binary is served to a
    process that sets it when they were compiled without."""
    run(dsl_env, "add", "tvm_ffi")
    assert len(toolkit.compiles()) == 1
    other = run(dsl_env, "add", "tvm_ffi", "--n", "4096")
    assert other["stats"] == {**other["stats"], "misses": 1, "compiles": 1, "binary_hits": 1}
    assert len(toolkit.compiles()) == 1  # the first kernel's binary
    again = run(dsl_env, "add", "tvm_ffi", "--n", "4096")
    assert again["stats"] == {**again["stats"], "hits": 1, "manifest_hits": 1, "binary_hits": 0}
    flagged = run({**dsl_env, "NVCC_APPEND_FLAGS": "-DKERNELCACHE_PROBE=1"}, "add", "tvm_ffi",
                  "--n", "4096")  # fmt: skip
    assert flagged["stats"] == {**flagged["stats"], "hits": 0, "misses": 1, "binary_hits": 0}
    assert len(toolkit.compiles()) == 2


def test_disable_cache_env_still_compiles_without_any_cache(
    toolkit: Toolkit, dsl_env: dict[str, str]
) -> None:
    env = {**dsl_env, "TILELANG_DISABLE_CACHE": "1"}
    for _ in range(2):
        report = run(env, "add", "tvm_ffi")
        assert report["stats"]["hits"] == report["stats"]["misses"] == 0
    assert len(toolkit.compiles()) == 2
    assert not stored_keys(dsl_env["KERNELCACHE_DIR"])


def _manifests(env: dict[str, str], delete: bool = False) -> list[dict[str, Any]]:
    """The variants of every header manifest in the test's cache (removed with ``delete``)."""
    import json

    from kernelcache.cache import Cache
    from kernelcache.nvcc.deps import MANIFEST
    from kernelcache.settings import Settings

    cache = Cache(settings=Settings.load({"KERNELCACHE_DIR": env["KERNELCACHE_DIR"]}))
    found = []
    for key in list(cache.tiers[-1].keys()):
        entry = cache.get(key)
        if entry is not None and MANIFEST in entry:
            found += json.loads(entry[MANIFEST])
            if delete:
                cache.delete(key)
    return found


@pytest.mark.slow
def test_header_manifest_hits_without_the_walk_and_misses_on_what_the_kernel_read(
    toolkit: Toolkit, dsl_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 23: a fresh process checks the headers the compile read (nvcc's own
    preprocessor runs say which), not the whole trees. An edit of a header the
    kernel did not read now hits; an edit of one it read, or a header created
    earlier in the search path, misses."""
    templates, cutlass = tmp_path / "tl" / "src", tmp_path / "cutlass" / "include"
    for label, copy in (("templates", templates), ("cutlass", cutlass)):
        shutil.copytree(str(keys.headers_folder(label)), copy, symlinks=True)
    env = {**dsl_env, "TL_TEMPLATE_PATH": str(templates), "TL_CUTLASS_PATH": str(cutlass)}
    hit = {"hits": 1, "misses": 0, "compiles": 0}

    run(env, "add", "tvm_ffi")
    [variant] = _manifests(env)  # recorded before the compiling process exited
    # Written by the compile's own device preprocessor run: nvcc ran once, no --dryrun.
    assert [r for r in toolkit.runs() if r.strip() != "--version"] == toolkit.compiles()
    assert len(toolkit.compiles()) == 1
    read = {os.path.normpath(row[0]) for row in variant["deps"]}
    common = templates / "tl_templates" / "cuda" / "common.h"
    numeric = cutlass / "cutlass" / "numeric_types.h"
    assert {str(common), str(numeric)} <= read
    first = run(env, "add", "tvm_ffi")
    assert first["stats"] == {**first["stats"], **hit, "manifest_hits": 1}

    # A header under the trees that the kernel did not read, edited: still a hit.
    unrelated = cutlass / "cutlass" / "gemm" / "device" / "gemm.h"
    assert str(unrelated) not in read
    unrelated.write_text(unrelated.read_text() + "\n// edited\n")
    again = run(env, "add", "tvm_ffi")
    assert again["stats"] == {**again["stats"], **hit, "manifest_hits": 1}
    assert len(toolkit.compiles()) == 1

    # A header created in an earlier -I folder, shadowing one the kernel read: a miss.
    (templates / "cutlass").mkdir()
    (templates / "cutlass" / "numeric_types.h").write_text(numeric.read_text() + "\n// shadow\n")
    assert run(env, "add", "tvm_ffi")["stats"]["compiles"] == 1
    assert len(toolkit.compiles()) == 2

    # A header the kernel read, edited: a miss.
    common.write_text(common.read_text() + "\n// edited\n")
    assert run(env, "add", "tvm_ffi")["stats"]["compiles"] == 1
    assert len(toolkit.compiles()) == 3

    # Without its manifest (evicted), the entry is found by the walk: a hit.
    _manifests(env, delete=True)
    walked = run(env, "add", "tvm_ffi")
    assert walked["stats"] == {**walked["stats"], **hit, "manifest_hits": 0}
