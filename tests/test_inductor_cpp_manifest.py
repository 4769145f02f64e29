"""Manifests of Inductor's C++ builds: a later process hits with no g++ run; a header that
changed or appeared gives a miss and a real rebuild (real g++ builds of small sources)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from kernelcache import Cache
from kernelcache.entry import Entry
from kernelcache.inductor import cpp, cpp_keys, cpp_manifest
from kernelcache.inductor.cpp_keys import Build, HeaderScans, direct_key
from kernelcache.inductor.headers import Scan, search_list
from kernelcache.nvcc import deps
from kernelcache.nvcc.args import parse
from kernelcache.nvcc.job import Job
from kernelcache.nvcc.job import lookup as nvcc_lookup
from kernelcache.stores.disk import DiskStore
from test_inductor_cpp_keys import _builder

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

#: A kernel as torch writes one: its headers by <...> (found on the -I path, not beside it).
SOURCE = "#include <h.h>\nint f() { return H; }\n"
#: One that includes "h.h": looked up beside the source first.
QUOTED = '#include "h.h"\nint f() { return H; }\n'


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
    assert key("e", LIBRARY_PATH=str(inc)) != base  # where -l finds libraries: another .so
    assert key("e", LD_RUN_PATH=str(inc)) != base  # the .so's run path
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


def test_a_quoted_include_is_looked_up_beside_the_source(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``#include "h.h"`` finds ``b/h.h`` before ``-Iinc/h.h``: the same source in b is
    another build, by its manifest (a variant holds its folder) and by its full key
    (the scan looks the include up where the compile does, not in the working directory)."""

    def build(where: str) -> tuple[Process, dict[str, int], Path]:
        process = Process(tmp_path, monkeypatch)
        builder = _builder(tmp_path / where, QUOTED, flags="-O2", inc=inc)
        return process, process.build(builder), Path(builder.target)

    _, first, old = build("a")
    assert first == {"misses": 1, "compiles": 1, "header_scans": 1}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "h.h").write_text("#define H 2\n")
    process, done, new = build("b")
    assert done == {"misses": 1, "compiles": 1, "header_scans": 1}
    assert process.compiled == [str(new)]
    assert new.read_bytes() != old.read_bytes()  # return 2, not a's return 1
    assert build("b")[1] == {"hits": 1, "direct_hits": 1}  # b's own variant
    # Another folder without h.h reads inc/h.h, as a did: a's entry, by the full key.
    assert build("c")[1] == {"hits": 1, "header_scans": 1}
    assert build("a")[1] == {"hits": 1, "direct_hits": 1}


def test_a_header_edited_in_one_process_is_scanned_again(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    process = Process(tmp_path, monkeypatch)
    old = _builder(tmp_path / "a", SOURCE, inc=inc)
    assert process.build(old) == {"misses": 1, "compiles": 1, "header_scans": 1}
    (inc / "h.h").write_text("#define H 2\n")
    new = _builder(tmp_path / "b", SOURCE, inc=inc)
    assert process.build(new) == {"misses": 1, "compiles": 1, "header_scans": 1}
    assert Path(new.target).read_bytes() != Path(old.target).read_bytes()


#: Manifests no kernelcache wrote: each variant is dropped, never read (issue 40's review).
DAMAGED = {
    "deps-not-rows": {"deps": [1], "absent": [], "result": "r"},
    "row-too-short": {"deps": [["/x", "d"]], "absent": [], "result": "r"},
    "path-not-a-string": {"deps": [[1, "d", None]], "absent": [], "result": "r"},
    "absent-not-a-list": {"deps": [], "absent": 5, "result": "r"},
    "signature-too-short": {"deps": [["<header>", "d", [1, 2]]], "absent": [], "result": "r"},
    "absent-names-not-strings": {"deps": [], "absent": [["/", None, [1]]], "result": "r"},
    "absent-group-too-short": {"deps": [], "absent": [["/", None]], "result": "r"},
    "result-not-a-string": {"deps": [], "absent": [], "result": 5},
    "folder-not-a-string": {"deps": [], "absent": [], "result": "r", "folder": 5},
}


@pytest.mark.parametrize("variant", list(DAMAGED.values()), ids=list(DAMAGED))
def test_a_damaged_manifest_is_a_miss(
    tmp_path: Path, inc: Path, monkeypatch: pytest.MonkeyPatch, variant: dict[str, Any]
) -> None:
    variant = json.loads(json.dumps(variant).replace("<header>", str(inc / "h.h")))
    manifest = Entry({deps.MANIFEST: json.dumps([variant]).encode()}, meta={"kind": "manifest"})
    assert deps.variants(manifest) == []
    # The launcher's lookup: a miss, not an exception.
    job = Job("nvcc", parse(["-c", "k.cu"]), {}, "command", "direct")
    assert nvcc_lookup({"direct": manifest}.get, job) is None
    # Inductor's: the build compiles, and its variant replaces the damaged one.
    process = Process(tmp_path, monkeypatch)
    builder = _builder(tmp_path / "a", SOURCE, inc=inc)
    direct = direct_key(Build.of(builder), "2.13.0", os.environ)
    process.cache.put(direct, manifest)
    assert process.build(builder) == {"misses": 1, "compiles": 1, "header_scans": 1}
    assert len(deps.variants(process.cache.get(direct))) == 1
    assert Process(tmp_path, monkeypatch).build(builder) == {"hits": 1, "direct_hits": 1}


def test_the_manifest_is_written_only_when_its_newest_variant_changes(
    tmp_path: Path, inc: Path
) -> None:
    cache = Cache([DiskStore(str(tmp_path / "tier"))], persist_stats=False)
    build = Build.of(_builder(tmp_path / "a", SOURCE, flags="-O2", inc=inc))
    scan = Scan("digest", (str(inc / "h.h"),), time.time_ns())
    for result in ("r1", "r1", "r2", "r2", "r1"):
        assert cpp_manifest.record(cache, "d", build, scan, result, {}) is None
    assert cache.stats()["disk"]["puts"] == 3  # r1, r2, r1 again: newest first
    assert [v["result"] for v in deps.variants(cache.get("d"))] == ["r1"]  # same headers


def test_a_response_file_is_in_the_direct_key_and_an_unreadable_one_records_nothing(
    tmp_path: Path, inc: Path
) -> None:
    options = tmp_path / "options"

    def build(where: str, flags: str) -> Build:
        return Build.of(_builder(tmp_path / where, SOURCE, flags=flags, inc=inc))

    options.write_text("-O2\n")
    first = direct_key(build("a", f"@{options}"), "2.13.0", {})
    options.write_text("-O3\n")
    assert direct_key(build("a", f"@{options}"), "2.13.0", {}) != first
    cache = Cache([DiskStore(str(tmp_path / "tier"))], persist_stats=False)
    scan = Scan("digest", (str(inc / "h.h"),), time.time_ns())
    why = cpp_manifest.record(cache, "d", build("b", f"@{tmp_path}/gone"), scan, "r", {})
    assert "cannot be followed" in str(why)
    assert cache.get("d") is None


def test_a_header_created_in_a_folder_the_compiler_searches_of_its_own_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/usr/local/include`` comes before ``/usr/include`` in g++'s own search list: a
    header created there shadows the one read (here under a ``--sysroot``, which moves
    that list without touching the machine's folders)."""
    root = tmp_path / "root"
    (root / "usr" / "include").mkdir(parents=True)
    (root / "usr" / "local" / "include").mkdir(parents=True)
    (root / "usr" / "include" / "h.h").write_text("#define H 1\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = f"-O2 -c --sysroot={root}"

    def build(where: str) -> tuple[dict[str, int], Path]:
        builder = _builder(tmp_path / where, SOURCE, flags=flags, inc=empty)
        return Process(tmp_path, monkeypatch).build(builder), Path(builder.target)

    _, old = build("a")
    assert build("b")[0] == {"hits": 1, "direct_hits": 1}
    (root / "usr" / "local" / "include" / "h.h").write_text("#define H 2\n")
    done, new = build("c")
    assert done == {"misses": 1, "compiles": 1, "header_scans": 1}
    assert new.read_bytes() != old.read_bytes()


def test_the_search_list_of_g_plus_plus_v() -> None:
    verbose = (
        'ignoring nonexistent directory "/nowhere"\n#include "..." search starts here:\n'
        " /q\n#include <...> search starts here:\n /usr/local/include\n"
        " /usr/lib/gcc/x86_64-linux-gnu/12/../../../../include/c++/12\n"
        " /Library/Frameworks (framework directory)\nEnd of search list.\n /not/listed\n"
    )
    assert search_list(verbose) == (
        "/q",
        os.path.realpath("/usr/local/include"),
        os.path.realpath("/usr/include/c++/12"),
        "/Library/Frameworks",
    )
