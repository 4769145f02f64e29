"""Manifests of Inductor's C++ builds: a later process hits with no g++ run; a header that
changed or appeared gives a miss and a real rebuild (real g++ builds of small sources)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from kernelcache import Cache
from kernelcache.inductor import cpp, cpp_keys, cpp_manifest
from kernelcache.inductor.cpp_keys import Build, HeaderScans, direct_key
from kernelcache.inductor.headers import Scan
from kernelcache.nvcc import deps
from kernelcache.stores.disk import DiskStore
from test_inductor_cpp_keys import SOURCE, _builder

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


class Process:
    """One process's build hook over a disk tier; counts the builds it ran."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cpp, "_scans", HeaderScans())  # nothing remembered in memory
        self.cache = Cache([DiskStore(str(tmp / "tier"))], persist_stats=False)
        self.compiled: list[str] = []
        headers = cpp.LazyHeaders(lambda *a, **k: "", str(tmp / "pch"))
        self.hook = cpp.BuildHook(self._compile, lambda: self.cache, headers, "2.13.0")

    def _compile(self, builder: Any) -> None:
        subprocess.run(shlex.split(builder.get_command_line()), check=True)
        self.compiled.append(str(builder.target))

    def build(self, builder: Any) -> dict[str, int]:
        """What the build did: the hook's counters that moved, and the scans it ran."""
        before = cpp.stats()
        self.hook(builder)
        after = cpp.stats()
        return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    # Headers written by the test a moment before its scan are no race here.
    monkeypatch.setattr(deps, "RACE_SLOP_NS", 0)


@pytest.fixture
def inc(tmp_path: Path) -> Path:
    folder = tmp_path / "inc"
    folder.mkdir()
    (folder / "h.h").write_text("#define H 1\n")
    return folder


def test_a_later_process_hits_through_the_manifest_without_a_scan(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Process(tmp_path, monkeypatch)
    assert first.build(_builder(tmp_path / "a", SOURCE, inc=inc)) == {
        "misses": 1,
        "compiles": 1,
        "header_scans": 1,
    }
    second = Process(tmp_path, monkeypatch)
    builder = _builder(tmp_path / "b", SOURCE, inc=inc)  # another cache folder: same build
    assert second.build(builder) == {"hits": 1, "direct_hits": 1}
    assert second.compiled == []
    assert Path(builder.target).read_bytes() == (tmp_path / "a" / "k.so").read_bytes()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param("edited", id="a-header-read-changed"),
        pytest.param("shadowed", id="a-header-appeared-earlier-in-the-path"),
    ],
)
def test_a_header_change_misses_and_rebuilds(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    front = tmp_path / "front"  # searched before inc, empty at first
    front.mkdir()
    flags = f"-O2 -I{front}"

    def build(where: str) -> tuple[Process, dict[str, int], Path]:
        process = Process(tmp_path, monkeypatch)
        builder = _builder(tmp_path / where, SOURCE, flags=flags, inc=inc)
        return process, process.build(builder), Path(builder.target)

    _, _, old = build("a")
    _, again, _ = build("b")
    assert again == {"hits": 1, "direct_hits": 1}
    if change == "edited":
        (inc / "h.h").write_text("#define H 2\n")
    else:
        (front / "h.h").write_text("#define H 2\n")
    process, done, new = build("c")
    assert done == {"misses": 1, "compiles": 1, "header_scans": 1}
    assert process.compiled == [str(new)]
    assert new.read_bytes() != old.read_bytes()  # return 2, not the stale return 1
    _, last, _ = build("d")
    assert last == {"hits": 1, "direct_hits": 1}  # the new state has its variant too


def test_a_link_of_objects_hits_directly(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = tmp_path / "k.o"
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    subprocess.run(["g++", "-c", "-fPIC", str(source), "-o", str(obj)], check=True)
    for where, expected in (
        ("a", {"misses": 1, "compiles": 1}),
        ("b", {"hits": 1, "direct_hits": 1}),
    ):
        builder = _builder(tmp_path / where, "", flags="-O2", inc=inc)
        builder._sources_args = str(obj)  # noqa: SLF001 (torch's field, as CppBuilder has it)
        assert Process(tmp_path, monkeypatch).build(builder) == expected


def test_what_the_direct_key_holds(tmp_path: Path, inc: Path) -> None:
    def key(where: str, source: str = SOURCE, flags: str = "-O2", **env: str) -> str:
        return direct_key(
            Build.of(_builder(tmp_path / where, source, flags=flags, inc=inc)), "2.13.0", env
        )

    base = key("a")
    assert key("b") == base  # the cache folder is not in it
    assert key("c", source=SOURCE + "int g;\n") != base
    assert key("d", flags="-O3") != base
    assert key("e", CPATH=str(inc)) != base
    (inc / "h.h").write_text("#define H 2\n")
    assert key("f") == base  # headers are the manifest's business


def test_variants_are_not_recorded_where_the_lookups_cannot_be_modelled(
    tmp_path: Path, inc: Path
) -> None:
    cache = Cache([DiskStore(str(tmp_path / "tier"))], persist_stats=False)
    build = Build.of(_builder(tmp_path / "a", SOURCE, flags="-O2 -Irelative", inc=inc))
    scan = Scan("digest", (str(inc / "h.h"),), time.time_ns())
    assert "not absolute" in str(cpp_manifest.record(cache, "d", build, scan, "r", {}))
    assert "not known" in str(cpp_manifest.record(cache, "d", build, Scan("x", None, 0), "r", {}))
    gone = Scan("digest", (str(inc / "gone.h"),), time.time_ns())
    assert "gone" in str(cpp_manifest.record(cache, "d", build, gone, "r", {}))
    assert "not absolute" in str(
        cpp_manifest.record(cache, "d", Build.of(_builder(tmp_path / "b", SOURCE, flags="-O2", inc=inc)),
                            Scan("digest", (str(inc / "h.h"),), time.time_ns()), "r", {"CPATH": "rel"})
    )  # fmt: skip
    assert cache.get("d") is None


def test_the_cpu_stands_for_march_native() -> None:
    identity = cpp_keys.cpu_identity()
    if identity is None:
        pytest.skip("no /proc/cpuinfo flags here")
    assert "flags:" in identity
    assert "cpu mhz" not in identity  # changes by the second
