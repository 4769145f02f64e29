"""kernelcache.cuda_core.ProgramCache: cuda.core's ProgramCacheResource over kernelcache tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("cuda.core")

from cuda.core import ObjectCode, Program, ProgramOptions
from cuda.core.utils import ProgramCacheResource

from kernelcache.cache import Cache
from kernelcache.cuda_core import KEY_PREFIX, ProgramCache, cache_key, header_digest, support
from kernelcache.entry import Entry
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

SOURCE = 'extern "C" __global__ void triple(float* x) { x[threadIdx.x] *= 3.0f; }'


def disk_cache(path: Path) -> Cache:
    return Cache([MemoryStore(), DiskStore(path)])


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    with disk_cache(tmp_path / "cache") as c:
        yield c


def compile_cubin(resource: ProgramCacheResource) -> ObjectCode:
    program = Program(SOURCE, "c++", ProgramOptions(arch="sm_90"))
    return program.compile("cubin", cache=resource)


def test_the_installed_cuda_core_is_a_tested_release_with_every_seam() -> None:
    from importlib.metadata import version

    verdict = support()
    assert (verdict.version, verdict.status) == (version("cuda-core"), "tested"), verdict.reason
    assert support("2.0.0").status == "untested"


def test_is_a_program_cache_resource(cache: Cache) -> None:
    assert isinstance(ProgramCache(cache), ProgramCacheResource)


def test_program_compile_cold_then_warm(cache: Cache, tmp_path: Path) -> None:
    resource = ProgramCache(cache)
    cold = compile_cubin(resource)
    hits_before = cache.stats()["memory"]["hits"]
    warm = compile_cubin(resource)
    assert cache.stats()["memory"]["hits"] == hits_before + 1
    assert bytes(warm.code) == bytes(cold.code)
    assert warm.code_type == "cubin"
    assert len(warm.code) > 100
    # Another process: a fresh Cache over the same directory hits on disk.
    with disk_cache(tmp_path / "cache") as other:
        again = compile_cubin(ProgramCache(other))
        assert other.stats()["disk"]["hits"] == 1
    assert bytes(again.code) == bytes(cold.code)


def test_entries_hold_bytes_and_json_metadata(cache: Cache) -> None:
    resource = ProgramCache(cache)
    obj = ObjectCode.from_cubin(
        b"\x7fELF-not-really", name="k", symbol_mapping={"f<int>": "_Z1fIiEvv"}
    )
    resource[b"key"] = obj
    entry = cache.get(cache_key(b"key"))
    assert isinstance(entry, Entry)
    assert entry["code"] == b"\x7fELF-not-really"
    assert entry.meta["code_type"] == "cubin"
    assert entry.meta["name"] == "k"
    assert b"pickle" not in entry.pack()
    assert entry.pack().startswith(b"KCENTRY\n")
    rebuilt = resource.get_object_code("key")
    assert rebuilt is not None
    assert rebuilt.code_type == "cubin"
    assert rebuilt.name == "k"
    assert rebuilt.symbol_mapping == {"f<int>": "_Z1fIiEvv"}
    assert bytes(rebuilt.code) == b"\x7fELF-not-really"


def test_mapping_behaviour(cache: Cache) -> None:
    resource = ProgramCache(cache)
    resource["k"] = b"abc"
    assert resource[b"k"] == b"abc"  # str and bytes keys are the same key
    assert resource.get("missing") is None
    with pytest.raises(KeyError):
        resource["missing"]
    with pytest.raises(KeyError):
        del resource["missing"]
    resource.update({"a": b"1", b"b": bytearray(b"2")})
    assert len(resource) == 3
    del resource["a"]
    assert resource.get("a") is None
    assert len(resource) == 2
    with pytest.raises(TypeError):
        resource["x"] = "not bytes"
    with pytest.raises(TypeError):
        resource[42] = b"x"  # type: ignore[index]
    with pytest.raises(ValueError, match="no code type"):
        resource.get_object_code("k")


def test_len_and_clear_leave_other_entries_alone(cache: Cache) -> None:
    resource = ProgramCache(cache)
    cache.put("f" * 64, Entry({"data": b"someone else's"}))
    resource["x"] = b"1"
    resource["y"] = b"2"
    assert len(resource) == 2
    resource.clear()
    assert len(resource) == 0
    assert cache.get("f" * 64) is not None
    assert all(k.startswith(KEY_PREFIX) for k in [cache_key("x"), cache_key(b"y")])


def test_path_backed_object_code_is_stored_by_content(cache: Cache, tmp_path: Path) -> None:
    resource = ProgramCache(cache)
    path = tmp_path / "k.cubin"
    path.write_bytes(b"cubin bytes")
    resource["p"] = ObjectCode.from_cubin(str(path))
    path.write_bytes(b"changed later")
    assert resource["p"] == b"cubin bytes"
    path.unlink()
    with pytest.raises(FileNotFoundError, match="no longer exists"):
        resource["q"] = ObjectCode.from_cubin(str(path))


def test_default_cache_uses_kernelcache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "env"))
    with ProgramCache() as resource:
        resource["k"] = b"v"
    assert (tmp_path / "env" / "v1" / "entries").is_dir()
    with disk_cache(tmp_path / "env") as other:
        assert ProgramCache(other)["k"] == b"v"


class _Sneaky(bytes):
    """Equal to (and hashing like) b"a": must never be taken for an already-derived key."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash(b"a")


def test_cache_keys_are_remembered_for_plain_bytes_and_str_only() -> None:
    assert cache_key(b"a") == cache_key("a") == cache_key(b"a")  # the second time remembered
    assert cache_key(_Sneaky(b"b")) == cache_key(b"b") != cache_key(b"a")
    # bytes-like keys are taken too, beyond the declared bytes | str
    assert cache_key(bytearray(b"a")) == cache_key(b"a")  # type: ignore[arg-type]


def _project(root: Path, header: str = "#define SCALE 2\n") -> ProgramOptions:
    (root / "inc").mkdir(parents=True)
    (root / "inc" / "scale.cuh").write_text(header)
    return ProgramOptions(arch="sm_90", include_path=[str(root / "inc")])


HEADER_SOURCE = '#include "scale.cuh"\nextern "C" __global__ void k(int* x) { *x = SCALE; }\n'


def test_header_digest_follows_content_not_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    here = header_digest(HEADER_SOURCE, _project(tmp_path / "a"))
    assert header_digest(HEADER_SOURCE, _project(tmp_path / "copy")) == here
    assert header_digest(HEADER_SOURCE, _project(tmp_path / "other", "#define SCALE 3\n")) != here
    # A header created where NVRTC looks first (the program's directory) shadows it.
    (tmp_path / "scale.cuh").write_text("#define SCALE 4\n")
    assert header_digest(HEADER_SOURCE, _project(tmp_path / "b")) != here


def test_header_digest_refuses_what_it_cannot_see(tmp_path: Path) -> None:
    options = _project(tmp_path)
    with pytest.raises(ValueError, match="use_pch"):
        header_digest(HEADER_SOURCE, ProgramOptions(arch="sm_90", use_pch=True))
    with pytest.raises(ValueError, match=r"cannot follow.*#include HEADER"):
        header_digest("#include HEADER\n", options)
