"""Command shapes CMake writes, and the wrong hits a ccache user knows, against plain nvcc.

Every call goes through the installed ``kernelcache`` executable (shell
front, client, server), as a build runs it: the miss runs in-process, the
hit comes from the server. Each shape's files must be the ones plain nvcc
writes, byte for byte (objects up to nvcc's pid in temporary names).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelcache.nvcc.launcher import launcher_stats, main
from launcher_env import (
    answered,
    clean_env,
    make_bin,
    reasons,
    start_server,
    stats,
    stop_server,
    without_file_symbol,
)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

KERNEL = """#include "common.cuh"
__global__ void scale(float* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }
"""
COMMON = "#pragma once\n__device__ inline float twice(float v) { return 2.0f * v; }\n"


class Launcher:
    """The ``kernelcache`` executable over one cache directory, with its server running."""

    def __init__(self, front: Path, cache_dir: Path) -> None:
        self.front, self.cache_dir = front, cache_dir
        self.env = clean_env(cache_dir)

    def __call__(
        self, args: list[str], cwd: Path, **env: str
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(self.front), "nvcc", *args],
            cwd=cwd,
            env={**self.env, **env},
            capture_output=True,
            check=False,
        )

    def outcome(self, args: list[str], cwd: Path, **env: str) -> str:
        """Run once; ``"server hit"``, ``"hit"``, ``"miss"``, ``"uncacheable"`` or ``"failed"``."""
        before = stats(self.cache_dir)
        proc = self(args, cwd, **env)
        after = stats(self.cache_dir)
        changed = [k for k in ("hits", "misses", "uncacheable", "failed") if after[k] != before[k]]
        assert len(changed) == 1, (before, after, proc.stderr)
        if changed[0] == "hits" and after["server_hits"] != before["server_hits"]:
            return "server hit"
        return {"hits": "hit", "misses": "miss"}.get(changed[0], changed[0])


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    root = tmp_path_factory.mktemp("shapes")
    tool = Launcher(make_bin(root / "bin"), root / "cache")
    start_server(tool.cache_dir, tool.env)
    yield tool
    stop_server(tool.cache_dir)


def project(root: Path, kernel: str = KERNEL) -> Path:
    (root / "od").mkdir(parents=True)
    (root / "k.cu").write_text(kernel)
    (root / "common.cuh").write_text(COMMON)
    time.sleep(0.05)  # older than the compile's start (RACE_SLOP_NS)
    return root


def written(root: Path, before: set[Path]) -> dict[str, bytes]:
    """Files created under ``root`` since ``before``, by relative path; then removed."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path not in before:
            data = path.read_bytes()
            out[str(path.relative_to(root))] = without_file_symbol(data)
            path.unlink()
    return out


SHAPES = [
    pytest.param(
        ["-forward-unknown-to-host-compiler", "-Wall", "-Wextra", "-c", "k.cu", "-o", "k.o"],
        id="forwarded-host-flags",
    ),
    pytest.param(["-c", "k.cu"], id="no-o"),
    pytest.param(["-c", "-dc", "k.cu", "-o", "k.o", "-MD", "-MF", "k.d"], id="c-and-dc"),
    pytest.param(["-c", "k.cu", "-odir", "od", "-MD"], id="odir"),
    pytest.param(["-c", "k.cu", "-o", "od/k.o.obj", "-MD"], id="md-without-mf"),
    pytest.param(["-ptx", "k.cu", "-odir", "od/", "-MMD"], id="ptx-odir-mmd"),
    pytest.param(["-cubin", "k.cu", "-MD", "-MT", "custom"], id="cubin-no-o-md-mt"),
]


@pytest.mark.parametrize("args", SHAPES)
def test_shape_is_cached_and_matches_plain_nvcc(
    launcher: Launcher, tmp_path: Path, args: list[str]
) -> None:
    # A kernel of its own: shapes that differ only in output names share a key.
    root = project(tmp_path / "p", KERNEL.replace("scale", f"scale_{abs(hash(tmp_path.name))}"))
    args = ["-arch=sm_90", *args]
    before = set(root.rglob("*"))
    plain = subprocess.run(["nvcc", *args], cwd=root, capture_output=True, check=True)
    expected = written(root, before)
    assert expected, "plain nvcc wrote nothing?"
    assert launcher.outcome(args, root) == "miss"
    assert written(root, before) == expected
    hit = launcher(args, root)
    assert hit.returncode == 0
    assert hit.stderr == plain.stderr
    assert written(root, before) == expected
    assert launcher.outcome(args, root) == "server hit"


def test_output_names_are_not_keyed(launcher: Launcher, tmp_path: Path) -> None:
    """A hit for another output name writes that name's files, as plain nvcc would."""
    root = project(tmp_path / "p", KERNEL.replace("scale", "renamed"))
    before = set(root.rglob("*"))
    assert launcher.outcome(["-arch=sm_90", "-c", "k.cu", "-MD"], root) == "miss"
    written(root, before)
    args = ["-arch=sm_90", "-c", "k.cu", "-odir", "od", "-MD"]
    assert launcher.outcome(args, root) == "server hit"
    served = written(root, before)
    subprocess.run(["nvcc", *args], cwd=root, check=True, capture_output=True)
    assert served == written(root, before)
    assert set(served) == {"od/k.o", "od/k.d"}


def test_time_macros_are_not_cached(launcher: Launcher, tmp_path: Path) -> None:
    root = project(tmp_path / "p", KERNEL + 'const char* built = __DATE__ " " __TIME__;\n')
    args = ["-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]
    assert launcher.outcome(args, root) == "uncacheable"
    assert launcher.outcome(args, root) == "uncacheable"
    assert (
        reasons(launcher.cache_dir).get("uses __DATE__", 0)
        + reasons(launcher.cache_dir).get("uses __TIME__", 0)
        == 2
    )
    # ccache's switch: the user accepts the old time.
    assert launcher.outcome(args, root, KERNELCACHE_SLOPPINESS="time_macros") == "miss"
    assert launcher.outcome(args, root, KERNELCACHE_SLOPPINESS="time_macros") == "server hit"


def test_time_macro_in_a_header(launcher: Launcher, tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    (root / "common.cuh").write_text(COMMON + "static const char* stamp = __TIMESTAMP__;\n")
    time.sleep(0.05)
    args = ["-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]
    assert launcher.outcome(args, root) == "uncacheable"
    assert reasons(launcher.cache_dir)["uses __TIMESTAMP__"] >= 1


@pytest.mark.parametrize(
    "include",
    [
        pytest.param('#include "inc.h"', id="quoted"),
        pytest.param("#include <inc.h>", id="angle"),
        pytest.param("#if __has_include(<inc.h>)\n#include <inc.h>\n#endif", id="has-include"),
    ],
)
def test_a_header_created_earlier_in_the_search_path_misses(
    launcher: Launcher, tmp_path: Path, include: str
) -> None:
    root = tmp_path / "p"
    for d in ("a", "b"):
        (root / d).mkdir(parents=True)
    kernel = f"k{sum(include.encode())}"  # one per case: equal preprocessed outputs are shared
    (root / "k.cu").write_text(
        include + f"\n__global__ void {kernel}(float* x) {{ x[0] = VALUE; }}\n"
    )
    (root / "b" / "inc.h").write_text("#define VALUE 1.0f\n")
    time.sleep(0.05)
    args = ["-arch=sm_90", "-ptx", "-Ia", "-Ib", "k.cu", "-o", "k.ptx"]
    assert launcher.outcome(args, root) == "miss"
    assert launcher.outcome(args, root) == "server hit"
    (root / "a" / "unrelated.h").write_text("// the directory changed, not the lookup\n")
    assert launcher.outcome(args, root) == "server hit"
    (root / "a" / "inc.h").write_text("#define VALUE 2.0f\n")
    time.sleep(0.05)
    assert launcher.outcome(args, root) == "miss"
    subprocess.run(["nvcc", *args[:-1], "plain.ptx"], cwd=root, check=True, capture_output=True)
    assert (root / "k.ptx").read_bytes() == (root / "plain.ptx").read_bytes()
    assert b"1073741824" in (root / "k.ptx").read_bytes()  # 2.0f, from a/inc.h
    os.unlink(root / "a" / "inc.h")
    assert launcher.outcome(args, root) == "server hit"  # the first variant again


# How many preprocessor passes a miss costs ------------------------------------


def test_a_first_compile_preprocesses_no_more_than_plain_nvcc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold miss takes its preprocessed key from nvcc's own (kept) passes: no extra ``-E``.

    The host compiler is a wrapper that logs each call, so the passes are
    counted, not timed. A comment-only edit afterwards still hits through the
    preprocessed key, which then costs one preprocessing of its own.
    """
    real = shutil.which("gcc")
    assert real is not None
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "bin" / "gcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    root = tmp_path / "p"
    root.mkdir()
    source = "__global__ void counted(float* y) { y[threadIdx.x] *= 2.0f; }\n"
    (root / "k.cu").write_text(source)
    time.sleep(0.05)  # older than the compile's start (RACE_SLOP_NS)
    monkeypatch.chdir(root)
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    for name in ("KERNELCACHE_BASEDIR", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN"):
        monkeypatch.delenv(name, raising=False)
    args = ["-ccbin", str(wrapper), "-arch=sm_90", "-c", "k.cu", "-o", "k.o", "-MD", "-MF", "k.o.d"]

    def passes(run: Callable[[], object]) -> int:
        log.write_text("")
        run()
        # nvcc's own probe of the compiler preprocesses a temporary file, not k.cu
        words = [line.split() for line in log.read_text().splitlines()]
        return sum("-E" in w and "k.cu" in w for w in words)

    plain = passes(lambda: subprocess.run(["nvcc", *args], check=True, capture_output=True))
    assert plain >= 2  # the host pass and one per device architecture
    before = launcher_stats()
    assert passes(lambda: main(["nvcc", *args])) == plain
    assert launcher_stats()["misses"] == before.get("misses", 0) + 1
    (root / "k.cu").write_text(source + "// a comment\n")
    time.sleep(0.05)  # older than the compile's start (RACE_SLOP_NS): else not recorded
    assert passes(lambda: main(["nvcc", *args])) == plain  # the preprocessed lookup only
    after = launcher_stats()
    assert after["hits"] == before.get("hits", 0) + 1
    assert after.get("preprocessed_hits", 0) == before.get("preprocessed_hits", 0) + 1


def _imported(proc: subprocess.CompletedProcess[bytes]) -> set[bytes]:
    """The modules a call's process imported (its ``PYTHONPROFILEIMPORTTIME`` lines)."""
    lines = proc.stderr.splitlines()
    return {line.rsplit(b"|", 1)[1].strip() for line in lines if b"import time:" in line}


def _same_as_plain_nvcc(root: Path, args: list[str]) -> None:
    """``k.o`` is what plain nvcc writes for the same compile (up to the file symbol)."""
    plain = subprocess.run(["nvcc", *args[:3], "-o", "plain.o", "-MD"], cwd=root)
    assert plain.returncode == 0
    assert without_file_symbol((root / "k.o").read_bytes()) == without_file_symbol(
        (root / "plain.o").read_bytes()
    )


def _rebuilt(tool: Launcher, root: Path, args: list[str], source: str) -> dict[str, int]:
    """Write ``source`` as ``k.cu`` and compile it through the front, which must not import the
    cache in the caller; how the launcher's statistics moved."""
    (root / "k.cu").write_text(source)
    time.sleep(0.05)  # older than the compile's start (RACE_SLOP_NS)
    before = stats(tool.cache_dir)
    proc = tool(args, root, PYTHONPROFILEIMPORTTIME="1")
    assert proc.returncode == 0, proc.stderr
    assert b"kernelcache.cache" not in _imported(proc)
    after = stats(tool.cache_dir)
    return {k: after[k] - before[k] for k in after}


def _answers(cache_dir: Path) -> dict[str, int]:
    """How many answers of each kind the server gave, both clients together."""
    counts: dict[str, int] = {}
    for key, n in answered(cache_dir).items():
        kind = key.rsplit(" ", 1)[1]
        counts[kind] = counts.get(kind, 0) + n
    return counts


def test_a_first_compile_is_run_by_the_caller_and_stored_by_the_server(tmp_path: Path) -> None:
    """A cold miss imports no cache in a new process: the warm server plans and stores it.

    The client's fallback process asks the server for a plan, runs nvcc
    itself and sends the run back (issue 23: importing the cache cost ~0.25 s
    of CPU per cold object). Its imports are listed (``PYTHONPROFILEIMPORTTIME``).
    """
    tool = Launcher(make_bin(tmp_path / "bin"), tmp_path / "cache")
    start_server(tool.cache_dir, tool.env)
    root = project(tmp_path / "p", KERNEL.replace("scale", "planned"))
    args = ["-arch=sm_90", "-c", "k.cu", "-o", "k.o", "-MD"]
    try:
        before = stats(tool.cache_dir)
        # Without coverage's start-up in this one call: it imports what the caller must not.
        quiet = {"COVERAGE_PROCESS_START": "", "COVERAGE_PROCESS_CONFIG": ""}
        proc = tool(args, root, PYTHONPROFILEIMPORTTIME="1", **quiet)
        assert proc.returncode == 0, proc.stderr
        assert stats(tool.cache_dir)["misses"] == before["misses"] + 1
        imported = _imported(proc)
        assert b"kernelcache.nvcc.compiling" in imported
        assert b"kernelcache.nvcc.procs" in imported
        # Neither the cache nor what the caller's ~20 ms of imports used to be (issue 23).
        heavy = {b"kernelcache.cache", b"subprocess", b"tempfile", b"shutil", b"typing", b"runpy"}
        assert not heavy & imported, imported
        _same_as_plain_nvcc(root, args)
        assert tool.outcome(args, root) == "server hit"
    finally:
        stop_server(tool.cache_dir)
    counts = _answers(tool.cache_dir)
    assert counts.get("compile", 0) == 1, counts
    assert counts.get("stored", 0) == 1, counts


def test_an_edited_file_is_preprocessed_and_compiled_by_the_caller(tmp_path: Path) -> None:
    """An edit-and-rebuild imports no cache in a new process either (issue 23).

    A command stored under a preprocessed key before may be found there again,
    so its preprocessing runs first, in the caller (the server answers one
    request at a time); the server looks its digests up. A comment-only edit
    is restored by the server; a real edit is compiled by the caller and
    stored by the server. The in-process launcher (its import of the whole
    cache and its second direct lookup) cost ~0.2 s per rebuilt file.
    """
    tool = Launcher(make_bin(tmp_path / "bin"), tmp_path / "cache")
    start_server(tool.cache_dir, tool.env)
    kernel = KERNEL.replace("scale", "edited")
    root = project(tmp_path / "p", kernel)
    args = ["-arch=sm_90", "-c", "k.cu", "-o", "k.o", "-MD"]
    try:
        assert tool(args, root).returncode == 0  # the first compile: stored, key learned
        counted = _rebuilt(tool, root, args, kernel + "// a comment\n")
        assert (counted["hits"], counted["preprocessed_hits"], counted["misses"]) == (1, 1, 0)
        edited = kernel.replace("x[threadIdx.x])", "x[threadIdx.x]) + 1.0f")
        counted = _rebuilt(tool, root, args, edited)
        assert (counted["hits"], counted["misses"]) == (0, 1)
        _same_as_plain_nvcc(root, args)
        assert tool.outcome(args, root) == "server hit"  # stored under its new key
    finally:
        stop_server(tool.cache_dir)
    counts = _answers(tool.cache_dir)
    assert counts.get("preprocess", 0) == 2, counts
    assert counts.get("compile", 0) == 2, counts
    assert counts.get("stored", 0) == 2, counts


def test_without_the_preprocessed_key_a_miss_is_still_compiled_by_the_caller(
    tmp_path: Path,
) -> None:
    """``KERNELCACHE_NVCC_PREPROCESSED=0`` (ccache's depend mode) skips the preprocessing after
    a direct miss; it used to skip the server's plan too, and every miss then started the
    in-process launcher (the whole cache imported, ~0.25 s of CPU; issue 23). Now the
    caller compiles without ``--keep`` and the server stores the result under the direct
    key and its inputs."""
    tool = Launcher(make_bin(tmp_path / "bin"), tmp_path / "cache")
    tool.env["KERNELCACHE_NVCC_PREPROCESSED"] = "0"
    start_server(tool.cache_dir, tool.env)
    kernel = KERNEL.replace("scale", "depend")
    root = project(tmp_path / "p", kernel)
    args = ["-arch=sm_90", "-c", "k.cu", "-o", "k.o", "-MD"]
    try:
        for source in (kernel, kernel + "// a comment\n"):  # first compile, then an edit
            counted = _rebuilt(tool, root, args, source)
            assert (counted["misses"], counted["hits"]) == (1, 0)
        _same_as_plain_nvcc(root, args)
        assert tool.outcome(args, root) == "server hit"
    finally:
        stop_server(tool.cache_dir)
    counts = _answers(tool.cache_dir)
    assert counts.get("compile", 0) == 2, counts
    assert counts.get("stored", 0) == 2, counts
    assert counts.get("preprocess", 0) == 0, counts
