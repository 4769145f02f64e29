"""Keys of Inductor's C++ builds: what must change a key, what must not (no compile runs here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from kernelcache import Cache, _fs
from kernelcache.inductor import cpp, cpp_keys
from kernelcache.inductor.cpp_keys import (
    FIELDS,
    Build,
    HeaderScans,
    Uncacheable,
    build_key,
    directives,
    missing_fields,
)
from kernelcache.inductor.headers import dependencies
from kernelcache.nvcc.includes import SearchPath
from kernelcache.patching import Patches
from kernelcache.stores.memory import MemoryStore

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


class FakeBuilder(SimpleNamespace):
    """The fields of torch 2.13's CppBuilder that a key reads."""

    def get_command_line(self) -> str:
        return (
            f"g++ {self._sources_args} {self._definitions_args} {self._cflags_args} "
            f"{self._include_dirs_args} -o {self.target}"
        )

    def get_target_file_path(self) -> str:
        return str(self.target)


def _builder(where: Path, source: str, *, flags: str = "-O3 -march=native", inc: Path) -> Any:
    where.mkdir(parents=True, exist_ok=True)
    (where / "k.cpp").write_text(source)
    return FakeBuilder(
        _sources_args=str(where / "k.cpp"),
        _include_dirs_args=f"-I{inc} ",
        _definitions_args="-D X=1 ",
        _cflags_args=f"{flags} -shared -fPIC ",
        _passthrough_parameters_args="",
        _precompiling=False,
        _compile_only=False,
        _preprocessing=False,
        _use_relative_path=False,
        target=where / "k.so",
    )


SOURCE = '#include "h.h"\nint f() { return H; }\n'


def _key(builder: Any, torch_version: str = "2.13.0") -> str:
    return build_key(Build.of(builder), HeaderScans(), torch_version)


@pytest.fixture
def inc(tmp_path: Path) -> Path:
    folder = tmp_path / "inc"
    folder.mkdir()
    (folder / "h.h").write_text("#define H 1\n")
    return folder


def test_same_build_in_other_directories_has_one_key(tmp_path: Path, inc: Path) -> None:
    assert _key(_builder(tmp_path / "a", SOURCE, inc=inc)) == _key(
        _builder(tmp_path / "b" / "c", SOURCE, inc=inc)
    )


@pytest.mark.parametrize(
    ("change"),
    [
        pytest.param("source", id="source"),
        pytest.param("flags", id="flags"),
        pytest.param("header", id="header-content"),
        pytest.param("torch", id="torch-release"),
    ],
)
def test_what_changes_the_binary_changes_the_key(tmp_path: Path, inc: Path, change: str) -> None:
    before = _key(_builder(tmp_path / "a", SOURCE, inc=inc))
    source, flags = SOURCE, "-O3 -march=native"
    if change == "source":
        source = SOURCE.replace("return H", "return H + 1")
    elif change == "flags":
        flags = "-O2 -march=native"
    elif change == "header":
        (inc / "h.h").write_text("#define H 2\n")
    release = "2.15.0" if change == "torch" else "2.13.0"
    assert _key(_builder(tmp_path / "b", source, flags=flags, inc=inc), release) != before


def test_a_header_that_cannot_be_found_is_uncacheable(tmp_path: Path, inc: Path) -> None:
    builder = _builder(tmp_path / "a", '#include "missing.h"\n', inc=inc)
    with pytest.raises(Uncacheable, match="preprocessing"):
        _key(builder)


def test_directives_keep_continuations_and_commented_hashes() -> None:
    text = "int a;\n#define M \\\n  2\n/* c */ #include <x>\ncode();\n  # if 1\n"
    assert directives(text) == "#define M \\\n  2\n/* c */ #include <x>\n  # if 1\n"


def test_directives_leave_out_openmp_pragmas() -> None:
    # g++ 12 fails on them under -fopenmp -E -fdirectives-only (every parallel kernel).
    text = "#include <x>\n  #pragma omp parallel for \\\n collapse(2)\n#pragma once\n"
    assert directives(text) == "#include <x>\n#pragma once\n"


def test_a_kernel_with_openmp_pragmas_is_keyed(tmp_path: Path, inc: Path) -> None:
    # A directive after the pragma is what g++ 12 fails on (torch's kernels: #ifdef lines).
    loop = (
        "void g(int* a) {\n  #pragma omp parallel for\n  for (int i = 0; i < 8; ++i) a[i] = H;\n}\n"
    )
    source = SOURCE + loop + "#define AFTER 1\n"
    assert _key(_builder(tmp_path / "a", source, flags="-O3 -fopenmp", inc=inc))


def test_install_and_restore_put_torch_back_exactly() -> None:
    from torch._inductor import codecache, cpp_builder

    before = (cpp_builder.CppBuilder.__dict__["build"], vars(codecache)[cpp.PRECOMPILE])
    patches = Patches()
    cpp.install(patches, lambda: Cache([MemoryStore()], persist_stats=False))
    assert cpp_builder.CppBuilder.__dict__["build"] is not before[0]
    assert vars(codecache)[cpp.PRECOMPILE] is not before[1]
    patches.restore()
    assert (cpp_builder.CppBuilder.__dict__["build"], vars(codecache)[cpp.PRECOMPILE]) == before


def test_a_builder_without_a_field_the_keys_read_gets_no_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor import cpp_builder

    assert missing_fields(cpp_builder.CppBuilder) == []
    assert missing_fields(type("Bare", (), {"get_command_line": lambda self: ""})) == [
        f for f in FIELDS if f != "get_command_line"
    ]
    before = cpp_builder.CppBuilder.__dict__["build"]
    monkeypatch.setattr(cpp_keys, "FIELDS", (*FIELDS, "_renamed_in_a_later_torch"))
    patches = Patches()
    with pytest.warns(RuntimeWarning, match=r"lacks CppBuilder\._renamed_in_a_later_torch"):
        cpp.install(patches, lambda: pytest.fail("the cache was asked"))
    assert cpp_builder.CppBuilder.__dict__["build"] is before
    patches.restore()


def test_builds_skip_the_memory_tier_and_memos_stay_local(tmp_path: Path) -> None:
    from kernelcache.stores.disk import DiskStore
    from kernelcache.stores.redis import RedisStore

    tiers = [MemoryStore(), DiskStore(str(tmp_path / "d")), RedisStore("redis://127.0.0.1:1/0")]
    cache = Cache(tiers, persist_stats=False)
    assert cpp.runnable(cache).tiers == tiers[1:]
    assert cpp.local(cache).tiers == tiers[1:2]
    assert cpp.runnable(cache) is cpp.runnable(cache)


def test_force_disable_caches_compiles_without_the_cache(tmp_path: Path, inc: Path) -> None:
    from torch._inductor import config

    calls: list[Any] = []

    def compile_it(builder: Any) -> None:
        calls.append(builder)
        Path(builder.target).write_bytes(b"\x7fELF")

    headers = cpp.LazyHeaders(lambda *a, **k: "", str(tmp_path / "h"))
    hook = cpp.BuildHook(compile_it, lambda: pytest.fail("the cache was asked"), headers, "2.13.0")
    builder = _builder(tmp_path / "a", SOURCE, inc=inc)
    before = cpp.stats()["uncached"]
    # torch's own patch: from 2.15 the switch is an alias, which monkeypatch's undo deletes.
    with config.patch(force_disable_caches=True):
        hook(builder)
    assert calls == [builder]
    assert cpp.stats()["uncached"] == before + 1


def test_header_scans_are_remembered_until_a_header_changes(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)  # stats may vouch for files just written
    header = inc / "h.h"
    front = tmp_path / "front"  # searched before inc, empty at first
    front.mkdir()
    records: dict[str, bytes] = {}
    memo = (records.get, records.__setitem__)
    gxx = str(shutil.which("g++"))
    text = "#include <h.h>\n"
    search = SearchPath([], [str(front), str(inc)], [], None)
    flags = [f"-I{front}", f"-I{inc}"]

    def scan(scans: HeaderScans | None = None) -> tuple[str, int]:
        scans = scans or HeaderScans()  # a new process: nothing remembered in memory
        return scans.digest(gxx, "g++ identity", flags, text, memo, None, search).digest, scans.runs

    first, runs = scan()
    assert (runs, len(records)) == (1, 1)
    assert scan() == (first, 0)
    header.write_text("#define H 22\n")  # another size: a new signature at any clock
    changed, runs = scan()
    assert runs == 1
    assert changed != first
    one = HeaderScans()  # one process, whose memory is checked as the memo is
    assert scan(one) == (changed, 0)
    (front / "h.h").write_text("#define H 3\n")  # found before inc/h.h from now on
    shadowed, runs = scan(one)
    assert runs == 1
    assert shadowed not in (first, changed)
    assert scan() == (shadowed, 0)


def test_header_scans_without_a_search_path_are_not_remembered(inc: Path) -> None:
    scans = HeaderScans()
    records: dict[str, bytes] = {}
    for _ in range(2):
        scans.digest(
            str(shutil.which("g++")),
            "id",
            [f"-I{inc}"],
            "#include <h.h>\n",
            (records.get, records.__setitem__),
        )
    assert (scans.runs, records) == (2, {})  # fmt: skip


def test_dependencies_of_a_make_rule() -> None:
    rule = "scan: /a/b.h \\\n /c/with\\ space.h -\n"
    assert dependencies(rule) == ["/a/b.h", "/c/with space.h"]


def test_a_quoted_include_beside_the_source_is_in_the_key(tmp_path: Path, inc: Path) -> None:
    """The scan finds ``"h.h"`` where the compile does: beside the source, not in the
    working directory (``b/h.h`` shadows ``-Iinc/h.h``)."""
    a = _key(_builder(tmp_path / "a", SOURCE, inc=inc))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "h.h").write_text("#define H 2\n")
    assert _key(_builder(tmp_path / "b", SOURCE, inc=inc)) != a
    assert _key(_builder(tmp_path / "c", SOURCE, inc=inc)) == a  # no c/h.h: inc's, as a's


def test_quoted_includes_beside_inputs_in_two_folders_are_uncacheable(
    tmp_path: Path, inc: Path
) -> None:
    builder = _builder(tmp_path / "a", SOURCE, inc=inc)
    (tmp_path / "pre.h").write_text('#include "h.h"\n')
    builder._include_dirs_args = f"-I{inc} -include {tmp_path / 'pre.h'} "  # noqa: SLF001
    with pytest.raises(Uncacheable, match="2 folders"):
        _key(builder)
    relative = _builder(tmp_path / "b", SOURCE, inc=inc)
    relative._include_dirs_args = "-Iinc "  # noqa: SLF001 (from the working directory)
    with pytest.raises(Uncacheable, match="relative search option"):
        _key(relative)


def test_a_launcher_before_the_compiler_keys_the_compiler_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/usr/lib/ccache/g++`` is ccache: the g++ it runs (next on PATH) is keyed by content."""
    real = _fs.realpath(str(shutil.which("g++")))
    launcher = tmp_path / "launcher"  # runs the next g++ on PATH, as ccache does
    launcher.write_text('#!/bin/sh\nPATH="${PATH#*:}" exec g++ "$@"\n')
    launcher.chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "g++").symlink_to(launcher)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "g++").symlink_to(real)
    (tmp_path / "two").mkdir()
    other = tmp_path / "two" / "x86_64-linux-gnu-g++-99"  # another build of g++
    other.write_bytes(Path(real).read_bytes() + b"\0")
    other.chmod(0o755)
    (tmp_path / "two" / "g++").symlink_to(other)
    wrapped = str(tmp_path / "bin" / "g++")

    def files(behind: str) -> str:
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{tmp_path / behind}")
        return cpp_keys.compiler_files(wrapped)

    assert files("one") != files("two")
    assert cpp_keys.driver(wrapped) == str(tmp_path / "two" / "g++")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{tmp_path / 'empty'}")  # nothing behind it
    assert cpp_keys.driver(wrapped) == wrapped
    assert cpp_keys.compiler_files(wrapped).startswith("launcher\nrc=")  # toolchain.executable
    assert cpp_keys.driver(real) == real  # a compiler is its own


@pytest.mark.parametrize("flag", ["-march=native", "-mtune=native", "-mcpu=native"])
def test_native_options_depend_on_the_cpu(tmp_path: Path, inc: Path, flag: str) -> None:
    assert cpp_keys._native(Build.of(_builder(tmp_path, SOURCE, flags=flag, inc=inc)))  # noqa: SLF001
    assert not cpp_keys._native(Build.of(_builder(tmp_path, SOURCE, flags="-O2", inc=inc)))  # noqa: SLF001


def test_unreadable_cache_folders_leave_the_cpu_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpp_keys.cpu_identity() is None:
        pytest.skip("no /proc/cpuinfo flags here")

    def denied(path: str) -> list[str]:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "listdir", denied)  # a sandbox that hides /sys
    identity = cpp_keys.cpu_identity.__wrapped__()
    assert identity is not None
    assert "flags:" in identity


def test_a_scan_is_remembered_per_search_path(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPATH adds a folder no flag names: a memo of the scan without it does not serve."""
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)
    front = tmp_path / "front"
    front.mkdir()
    (front / "h.h").write_text("#define H 3\n")
    records: dict[str, bytes] = {}
    memo = (records.get, records.__setitem__)
    gxx, text = str(shutil.which("g++")), "#include <h.h>\n"

    def scan(*both: Path) -> str:
        monkeypatch.setenv("CPLUS_INCLUDE_PATH", ":".join(str(f) for f in both))
        search = SearchPath([], [str(f) for f in both], [], None)
        return HeaderScans().digest(gxx, "id", [], text, memo, None, search).digest

    plain = scan(inc)
    assert scan(inc) == plain  # remembered
    assert scan(front, inc) != plain  # front/h.h, not the memo of inc/h.h
    assert len(records) == 2
