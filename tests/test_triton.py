"""kernelcache.triton: real Triton compiles (sm_90, ahead of time) through the manager.

Compiles run in subprocesses (fresh processes are the point of a disk cache)
via tests/triton_kernels.py, which reports what Triton's own compilation
listener saw: ``cache_hit`` and the lowering stages that ran.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

import triton

import kernelcache.triton as kt
import triton_kernels
from kernelcache import Cache, DiskStore, Entry, MemoryStore

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
KERNELS = ["add", "softmax", "matmul"]
MANAGER = "kernelcache.triton:CacheManager"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "KERNELCACHE_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]),
        TRITON_DEFAULT_FP_FUSION="1",  # else Triton 3.9 warns on every compile
        TRITON_HOME=str(tmp / "home"),
        TRITON_CACHE_DIR=str(tmp / "triton-dir"),
    )
    env.update(extra)
    return env


def _start(env: dict[str, str], kernels: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "triton_kernels.py"), *kernels],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out)
    return result


def _kc_env(tmp: Path, kc_dir: Path, **extra: str) -> dict[str, str]:
    """kernelcache as Triton's manager, its disk tier in TRITON_CACHE_DIR (as a Triton user sets it)."""
    return _env(tmp, TRITON_CACHE_MANAGER=MANAGER, TRITON_CACHE_DIR=str(kc_dir), **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Cold compile through kernelcache and through FileCacheManager (side by side), then warm."""
    tmp = tmp_path_factory.mktemp("triton")
    kc_dir = tmp / "kc"
    cold = _start(_kc_env(tmp, kc_dir), KERNELS)
    plain = _start(_env(tmp, TRITON_CACHE_DIR=str(tmp / "plain")), KERNELS)
    result = {"tmp": tmp, "kc_dir": kc_dir, "cold": _finish(cold), "plain": _finish(plain)}
    result["warm"] = _finish(_start(_kc_env(tmp, kc_dir), KERNELS))
    return result


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DiskStore]:
    """Each in-process test gets its own cache; Triton's env knobs point at kernelcache."""
    for name in [n for n in os.environ if n.startswith(("TRITON_", "KERNELCACHE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-dir"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)
    store = DiskStore(tmp_path / "kc")
    kt.set_cache(Cache([store]))
    yield store
    kt.set_cache(None)
    store.close()


def _disk_entries(kc_dir: Path) -> list[Entry]:
    store = DiskStore(kc_dir, read_only=True)
    entries = [store.get(info.key) for info in store.scan()]
    return [e for e in entries if e is not None]


# Versions --------------------------------------------------------------
def test_the_installed_triton_is_a_tested_release_with_every_seam() -> None:
    """Each cell of the version matrix runs this file: its Triton is inside TESTED."""
    verdict = kt.support()
    assert (verdict.version, verdict.status) == (triton.__version__, "tested"), verdict.reason


def test_a_newer_triton_installs_untested_and_one_without_a_seam_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert kt.support("3.10.0").status == "untested"
    monkeypatch.setattr(kt, "SEAMS", (*kt.SEAMS, "triton.runtime.cache:Gone"))
    verdict = kt.support("3.10.0")
    assert verdict.status == "refused"
    assert "lacks triton.runtime.cache:Gone" in verdict.reason
    assert "newest tested 3.9" in verdict.reason


# Fresh processes -------------------------------------------------------
def test_cold_process_compiles_every_stage(runs: dict[str, Any]) -> None:
    for name in KERNELS:
        assert runs["cold"][name]["cache_hit"] is False
        assert runs["cold"][name]["stages"] == ["ttir", "ttgir", "llir", "ptx", "cubin"]


def test_fresh_process_hits_and_runs_no_compilation_stage(runs: dict[str, Any]) -> None:
    for name in KERNELS:
        warm = runs["warm"][name]
        assert warm["cache_hit"] is True, name
        assert warm["stages"] == [], name
        assert warm["files"] == runs["cold"][name]["files"]
        # Triton loads the kernel from files inside the kernelcache directory.
        for path in warm["paths"].values():
            assert Path(path).is_relative_to(runs["kc_dir"]), path


def test_groups_byte_identical_to_file_cache_manager(runs: dict[str, Any]) -> None:
    for name in KERNELS:
        ours, theirs = runs["cold"][name], runs["plain"][name]
        assert ours["hash"] == theirs["hash"]
        assert ours["files"] == theirs["files"], name  # same children, same SHA-256
        assert set(ours["files"]) >= {f"{name}_kernel.cubin", f"{name}_kernel.json"}


def test_tritons_directory_holds_the_kernelcache_layout_only(runs: dict[str, Any]) -> None:
    # No FileCacheManager folders (<dir>/<KEY>/...): every file is inside the tier's layout.
    assert {p.name for p in runs["kc_dir"].iterdir()} <= {"v1", "CACHEDIR.TAG"}


def test_one_entry_per_group_with_names_not_paths(runs: dict[str, Any]) -> None:
    groups = [e for e in _disk_entries(runs["kc_dir"]) if e.meta.get("triton") == "group"]
    assert sorted(e.meta["group"] for e in groups) == sorted(f"{k}_kernel.json" for k in KERNELS)
    for entry in groups:
        _check_group(entry)
        assert str(runs["tmp"]) not in json.dumps(entry.meta)


def _check_group(entry: Entry) -> None:
    """Complete and self-consistent: index, children and the compile's own hash agree."""
    meta = entry.meta
    grp_name = kt.GROUP_PREFIX + meta["group"]
    index = json.loads(entry[grp_name])["child_paths"]
    assert index == {c: c for c in meta["children"]}  # names only, no absolute paths
    assert set(entry) == {*meta["children"], grp_name}
    metadata = json.loads(entry[meta["group"]])
    key = base64.b32encode(bytes.fromhex(metadata["hash"])).decode().rstrip("=")
    assert key == meta["triton_key"]
    assert entry[f"{metadata['name']}.cubin"][:4] == b"\x7fELF"


# Size cap --------------------------------------------------------------
def _tree_bytes(path: Path) -> int:
    return sum(
        p.stat().st_size
        for p in (path / "v1").rglob("*")
        if p.is_file() and "shards" not in p.parts
    )


def test_size_cap_evicts_and_triton_recompiles(tmp_path: Path) -> None:
    probe = DiskStore(tmp_path / "probe")
    kt.set_cache(Cache([probe]))
    kernel, seen = triton_kernels.compile_kernel("add")
    assert seen["cache_hit"] is False
    group_bytes = probe.usage()[1]  # packed entry + files extracted for Triton
    cubin = kernel.asm["cubin"]

    # Room for about one group per shard (the disk tier caps each of its 16 shards).
    cap = 16 * int(1.5 * group_bytes)
    store = DiskStore(tmp_path / "capped", max_bytes=cap)
    kt.set_cache(Cache([store]))
    kernel, seen = triton_kernels.compile_kernel("add")
    assert seen["cache_hit"] is False
    victim = base64.b32encode(bytes.fromhex(kernel.hash)).decode().rstrip("=")
    files = {c: Path(p).read_bytes() for c, p in kernel.metadata_group.items()}

    for i in range(48):  # three times the shard count: every shard overflows
        manager = kt.CacheManager(f"FILLER{i}")
        assert manager.get_group("add_kernel.json") is None
        paths = {child: manager.put(data, child) for child, data in files.items()}
        manager.put_group("add_kernel.json", paths)
        assert _tree_bytes(tmp_path / "capped") <= cap + group_bytes
    assert kt.CacheManager(victim).get_group("add_kernel.json") is None  # the oldest went
    assert store.counters.evictions > 0

    kernel, seen = triton_kernels.compile_kernel("add")
    assert seen["cache_hit"] is False
    assert seen["stages"]
    assert kernel.asm["cubin"] == cubin
    kernel, seen = triton_kernels.compile_kernel("add")
    assert seen["cache_hit"] is True
    assert _tree_bytes(tmp_path / "capped") <= cap + group_bytes


# Remote backend --------------------------------------------------------
def test_remote_backend_serves_a_new_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: DiskStore
) -> None:
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:RemoteCacheManager")
    monkeypatch.setenv("TRITON_REMOTE_CACHE_BACKEND", "kernelcache.triton:RemoteBackend")
    assert triton.knobs.cache.remote_manager_class is kt.RemoteBackend
    first, seen = triton_kernels.compile_kernel("softmax")
    assert seen["cache_hit"] is False
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "another-machine"))
    again, seen = triton_kernels.compile_kernel("softmax")
    assert seen["cache_hit"] is True
    assert again.asm["cubin"] == first.asm["cubin"]
    kinds = {e.meta.get("triton") for e in _disk_entries(tmp_path / "kc")}
    assert kinds == {"remote"}


def test_remote_backend_get_and_put() -> None:
    backend = kt.RemoteBackend("KEY")
    backend.put("a.cubin", b"\x00binary")
    backend.put("a.json", '{"text": 1}')  # type: ignore[arg-type]
    assert backend.get(["a.cubin", "a.json", "missing.ptx"]) == {
        "a.cubin": b"\x00binary",
        "a.json": b'{"text": 1}',
    }
    assert kt.RemoteBackend("OTHER").get(["a.cubin"]) == {}


# The manager without compiles -------------------------------------------
def test_triton_loads_the_classes_from_its_environment_variables() -> None:
    assert triton.knobs.cache.manager_class is kt.CacheManager
    from triton.runtime.cache import get_cache_manager

    assert isinstance(get_cache_manager("ab" * 32), kt.CacheManager)


def test_lone_put_is_published_at_once_with_its_file_name() -> None:
    # How the autotuner and runtime/build.py use a manager: get_file, then put.
    writer = kt.CacheManager("LAUNCHER")
    name = "cuda_utils.cpython-311-x86_64-linux-gnu.so"
    assert writer.get_file(name) is None
    path = writer.put(b"\x7fELF fake so", name)
    reader = kt.CacheManager("LAUNCHER")
    found = reader.get_file(name)
    assert found is not None
    assert Path(found).name == name
    assert Path(found).read_bytes() == Path(path).read_bytes() == b"\x7fELF fake so"
    reader.put('{"configs_timings": []}', "k.autotune.json", binary=False)
    assert Path(kt.CacheManager("LAUNCHER").get_file("k.autotune.json") or "").read_text() == (
        '{"configs_timings": []}'
    )


def test_group_is_invisible_until_put_group_then_complete(private_cache: DiskStore) -> None:
    writer, reader = kt.CacheManager("K"), kt.CacheManager("K")
    assert writer.get_group("k.json") is None
    group = {name: writer.put(data, name) for name, data in _FILES.items()}
    staged = Path(group["k.cubin"])
    assert staged.exists()
    assert writer.get_file("k.cubin") == str(staged)
    assert reader.get_group("k.json") is None
    assert reader.get_file("k.cubin") is None
    assert list(private_cache.keys()) == []

    grp_path = writer.put_group("k.json", group)
    assert not staged.exists()  # staging is gone; the group now names published files
    assert all(Path(p).is_relative_to(private_cache.path) for p in group.values())
    found = reader.get_group("k.json")
    assert found is not None
    assert set(found) == set(_FILES)
    assert {n: Path(p).read_bytes() for n, p in found.items()} == _FILES
    assert json.loads(Path(grp_path).read_text()) == {"child_paths": {n: n for n in _FILES}}
    assert reader.get_file("__grp__k.json") == grp_path
    assert kt.stats()["triton"]["groups_published"] >= 1


_FILES = {"k.source": b"module {}", "k.cubin": b"\x7fELF\x00\x01", "k.json": b'{"name": "k"}'}


def test_failed_compile_publishes_nothing_and_cleans_staging(private_cache: DiskStore) -> None:
    manager = kt.CacheManager("BROKEN")
    manager.get_group("k.json")
    staged = Path(manager.put(b"half", "k.ttir"))
    assert staged.exists()
    del manager
    gc.collect()
    assert not staged.exists()
    assert list(private_cache.keys()) == []
    assert kt.CacheManager("BROKEN").get_group("k.json") is None


def test_unusable_group_entry_is_a_miss(private_cache: DiskStore) -> None:
    key = kt.current().key("group", "BAD", "k.json")
    private_cache.put(key, Entry({"k.json": b"{}"}, meta={"children": ["k.json", "k.cubin"]}))
    assert kt.CacheManager("BAD").get_group("k.json") is None
    assert kt.stats()["triton"]["unusable_entries"] >= 1


def test_unsafe_file_names_are_refused() -> None:
    manager = kt.CacheManager("K")
    with pytest.raises(ValueError, match="unsafe artifact name"):
        manager.put(b"x", "../escape.cubin")
    manager.get_group("k.json")
    with pytest.raises(ValueError, match="unsafe artifact name"):
        manager.put_group("k.json", {"a/b": "/etc/hostname"})


def test_namespaces_keep_setups_apart(private_cache: DiskStore) -> None:
    cache = Cache([private_cache])
    kt.set_cache(cache, namespace="experiment-a")
    kt.CacheManager("K").put(b"a", "x.bin")
    assert kt.CacheManager("K").get_file("x.bin") is not None
    kt.set_cache(cache, namespace="experiment-b")
    assert kt.CacheManager("K").get_file("x.bin") is None


def test_environment_configures_the_default_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELCACHE_TRITON_DIR", str(tmp_path / "triton-only"))
    monkeypatch.setenv("KERNELCACHE_TRITON_MAX_SIZE", "64M")
    monkeypatch.setenv("KERNELCACHE_TRITON_NAMESPACE", "ns")
    kt.set_cache(None)
    cache = kt.get_cache()
    disk = [t for t in cache.tiers if isinstance(t, DiskStore)]
    assert [d.path for d in disk] == [str(tmp_path / "triton-only")]
    assert disk[0].max_bytes == 64 << 20
    assert kt.current().namespace == "ns"
    cache.close()


def test_dump_manager_stays_tritons_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_cache: DiskStore
) -> None:
    monkeypatch.setenv("TRITON_DUMP_DIR", str(tmp_path / "dump"))
    path = kt.CacheManager("K", dump=True).put("ttir text", "k.ttir")
    assert Path(path) == tmp_path / "dump" / "K" / "k.ttir"
    assert list(private_cache.keys()) == []


def test_memory_tier_serves_files_inside_the_disk_tier(tmp_path: Path) -> None:
    # The memory tier would otherwise hold the object we put, whose files go
    # to a temp directory that is never freed before exit.
    disk = DiskStore(tmp_path / "kc2")
    kt.set_cache(Cache([MemoryStore(), disk]))
    writer = kt.CacheManager("K")
    writer.get_group("k.json")
    group = {name: writer.put(data, name) for name, data in _FILES.items()}
    writer.put_group("k.json", group)
    found = kt.CacheManager("K").get_group("k.json")
    assert found == group
    assert all(Path(p).is_relative_to(disk.path) for p in found.values())
    # Published once, never read back: the memory tier serves the hit, with disk paths.
    assert disk.counters.hits == 0
    assert disk.counters.puts == 1


def test_without_a_writable_persistent_tier_the_process_still_hits(tmp_path: Path) -> None:
    DiskStore(tmp_path / "ro").close()
    memory = MemoryStore()
    kt.set_cache(Cache([memory, DiskStore(tmp_path / "ro", read_only=True)]))
    writer = kt.CacheManager("K")
    writer.get_group("k.json")
    writer.put_group("k.json", {name: writer.put(data, name) for name, data in _FILES.items()})
    found = kt.CacheManager("K").get_group("k.json")
    assert found is not None
    assert {n: Path(p).read_bytes() for n, p in found.items()} == _FILES
