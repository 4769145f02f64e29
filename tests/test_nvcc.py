"""The ``kernelcache nvcc`` launcher: real compiles, byte-identical outputs, keys, pass-through.

nvcc takes 0.5-2 s per compile on this machine, so the tests share one cache
and one warm project per module and use ``-cubin`` where the mode does not matter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelcache.nvcc import args as nvcc_args
from kernelcache.nvcc.launcher import launcher_stats, main
from launcher_env import without_file_symbol

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

KERNEL = """#include "common.cuh"
__global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int unused_on_purpose;  // a warning, so that stderr replay is tested
    if (i < n) y[i] = scale(a) * x[i] + y[i];
}
void launch(float a, const float* x, float* y, int n) {
    saxpy<<<(n + 255) / 256, 256>>>(a, x, y, n);
}
"""
COMMON = "#pragma once\n__device__ inline float scale(float v) { return 2.0f * v; }\n"
BASE = ["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]


def settle() -> None:
    """Let file timestamps fall behind the next compile's start (nvcc_deps.RACE_SLOP_NS)."""
    time.sleep(0.05)


def make_project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "k.cu").write_text(KERNEL)
    (root / "common.cuh").write_text(COMMON)
    (root / "unrelated.h").write_text("#define UNRELATED 1\n")
    settle()
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("nvcc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_DIR", str(root / "cache"))
        for name in (
            "KERNELCACHE_BASEDIR",
            "NVCC_APPEND_FLAGS",
            "NVCC_PREPEND_FLAGS",
            "NVCC_CCBIN",
        ):
            mp.delenv(name, raising=False)
        yield root


def launch(argv: list[str]) -> tuple[int, str]:
    """Run the launcher in-process; returns its exit code and what the stats say happened."""
    before = launcher_stats()
    rc = main(argv)
    after = launcher_stats()
    changed = [
        k
        for k in ("hits", "misses", "uncacheable", "failed")
        if after.get(k, 0) != before.get(k, 0)
    ]
    assert len(changed) == 1, (before, after)
    return rc, changed[0]


@pytest.fixture(scope="module")
def warm_project(workspace: Path) -> Path:
    """A project whose BASE compile is in the cache."""
    root = make_project(workspace / "warm")
    with pytest.MonkeyPatch.context() as mp:  # back where it was: later tests in this worker
        mp.chdir(root)
        assert launch(BASE) == (0, "misses")
        assert launch(BASE) == (0, "hits")
    return root


# Byte-identical outputs ------------------------------------------------------


@pytest.mark.parametrize("mode", ["-c", "-ptx", "-cubin", "-fatbin"])
def test_outputs_are_byte_identical_to_plain_nvcc(
    workspace: Path, mode: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    root = make_project(workspace / f"identical{mode}")
    monkeypatch.chdir(root)
    (root / "out").mkdir()
    args = ["-arch=sm_90", mode, "k.cu", "-o", "out/k.bin", "-MD", "-MF", "out/k.bin.d"]

    def outputs() -> tuple[bytes, bytes]:
        data = (root / "out" / "k.bin").read_bytes(), (root / "out" / "k.bin.d").read_bytes()
        shutil.rmtree(root / "out")
        (root / "out").mkdir()
        return data

    plain = subprocess.run(["nvcc", *args], capture_output=True, check=True)
    plain_out, plain_dep = outputs()
    capfd.readouterr()
    assert launch(["nvcc", *args]) == (0, "misses")
    cold_out, cold_dep = outputs()
    cold_err = capfd.readouterr().err
    assert launch(["nvcc", *args]) == (0, "hits")
    warm_out, warm_dep = outputs()
    warm_err = capfd.readouterr().err

    assert warm_out == cold_out
    assert warm_dep == cold_dep
    assert plain_dep == cold_dep
    assert plain_dep.startswith(b"out/k.bin : k.cu")
    if mode == "-c":
        assert without_file_symbol(plain_out) == without_file_symbol(cold_out)
    else:
        assert plain_out == cold_out
    assert "unused_on_purpose" in plain.stderr.decode()
    assert warm_err == cold_err
    assert "unused_on_purpose" in warm_err


def test_no_dependency_flags_and_another_output_name(
    warm_project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(warm_project)
    # The output path is not part of the key: the BASE result serves it.
    assert launch(["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "renamed.cubin"]) == (0, "hits")
    assert (warm_project / "renamed.cubin").read_bytes() == (warm_project / "k.cubin").read_bytes()


def test_dependency_file_target_follows_the_output_name(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_project(workspace / "deptarget")
    monkeypatch.chdir(root)
    first = ["nvcc", "-arch=sm_90", "-ptx", "k.cu", "-o", "a.ptx", "-MD", "-MF", "a.d"]
    second = ["nvcc", "-arch=sm_90", "-ptx", "k.cu", "-o", "b.ptx", "-MD", "-MF", "b.d"]
    launch(first)
    assert launch(second) == (0, "hits")
    subprocess.run(["nvcc", *second[1:-2], "-MF", "plain.d"], check=True, capture_output=True)
    assert (root / "b.d").read_bytes() == (root / "plain.d").read_bytes()
    assert (root / "a.d").read_bytes().replace(b"a.ptx", b"b.ptx") == (root / "b.d").read_bytes()


def test_mmd_records_system_headers_too(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_project(workspace / "mmd")
    monkeypatch.chdir(root)
    args = ["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin", "-MMD", "-MF", "k.d"]
    assert launch(args) == (0, "misses")
    user_dep = (root / "k.d").read_bytes()
    assert b"/usr/include" not in user_dep
    assert b"common.cuh" in user_dep
    assert launch(args) == (0, "hits")
    assert (root / "k.d").read_bytes() == user_dep


# Keys ---------------------------------------------------------------------------


def _edit(name: str, text: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        (root / name).write_text(text)

    return apply


def _touch(name: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        os.utime(root / name)

    return apply


def _nothing(root: Path) -> None:
    """The copy itself is the change."""


KEY_TABLE = [
    # (change to a copy of the warm project, argv, env, expected outcome)
    pytest.param(
        _edit("common.cuh", COMMON.replace("2.0f", "3.0f")), BASE, {}, "misses", id="header-edit"
    ),
    pytest.param(_edit("k.cu", KERNEL.replace("256", "128")), BASE, {}, "misses", id="source-edit"),
    # Preprocessed the same: found through the preprocessed key.
    pytest.param(_edit("k.cu", KERNEL + "// edited\n"), BASE, {}, "hits", id="source-comment"),
    pytest.param(
        _edit("common.cuh", COMMON.replace("#pragma once", "#pragma once  // a note")),
        BASE,
        {},
        "hits",
        id="header-comment",
    ),
    pytest.param(
        _edit("common.cuh", COMMON.replace("2.0f * v", "2.0f  *  v")),
        BASE,
        {},
        "hits",
        id="header-spaces",
    ),
    pytest.param(_nothing, [*BASE, "-DFOO=1"], {}, "misses", id="define"),
    pytest.param(_nothing, ["nvcc", "-arch=sm_80", *BASE[2:]], {}, "misses", id="arch"),
    pytest.param(_nothing, BASE, {"NVCC_APPEND_FLAGS": "-DBAR"}, "misses", id="nvcc-append-flags"),
    pytest.param(
        _edit("unrelated.h", "#define UNRELATED 2\n"), BASE, {}, "hits", id="unrelated-file"
    ),
    pytest.param(_touch("common.cuh"), BASE, {}, "hits", id="header-touched-not-changed"),
    pytest.param(_nothing, BASE, {}, "hits", id="copied-directory"),
    pytest.param(
        _nothing,
        ["nvcc", "--gpu-architecture", "sm_90", *BASE[2:]],
        {},
        "hits",
        id="option-spelling",
    ),
]


@pytest.mark.parametrize(("change", "argv", "env", "expected"), KEY_TABLE)
def test_key_table(
    warm_project: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Path], None],
    argv: list[str],
    env: dict[str, str],
    expected: str,
) -> None:
    copy = tmp_path / "deeper" / "copy"
    shutil.copytree(warm_project, copy)
    (copy / "k.cubin").unlink()
    change(copy)
    settle()
    monkeypatch.chdir(copy)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch(argv) == (0, expected)
    assert (copy / "k.cubin").stat().st_size > 100


def test_basedir_makes_absolute_paths_portable(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CMake passes absolute paths; KERNELCACHE_BASEDIR (like ccache's base_dir) shares them."""

    def build(root: Path) -> tuple[int, str]:
        (root / "build").mkdir(exist_ok=True)
        monkeypatch.chdir(root / "build")
        return launch(
            [
                "nvcc",
                "-arch=sm_90",
                "-cubin",
                f"-I{root}/include",
                str(root / "src" / "k.cu"),
                "-o",
                "k.cubin",
                "-MD",
                "-MT",
                "k.cubin",
                "-MF",
                "k.d",
            ]
        )

    first = workspace / "based" / "one"
    (first / "src").mkdir(parents=True)
    (first / "include").mkdir()
    (first / "src" / "k.cu").write_text(KERNEL)
    (first / "include" / "common.cuh").write_text(COMMON)
    settle()
    second = workspace / "based" / "two"
    shutil.copytree(first, second)
    settle()
    assert build(first) == (0, "misses")
    assert build(second) == (0, "misses"), "absolute paths are keyed as written by default"
    third = workspace / "based" / "three"
    shutil.copytree(first, third)
    settle()
    monkeypatch.setenv("KERNELCACHE_BASEDIR", str(workspace / "based" / "one"))
    assert build(first) == (0, "misses")  # a new key: paths now relative to the base dir
    monkeypatch.setenv("KERNELCACHE_BASEDIR", str(third))
    assert build(third) == (0, "hits")
    restored = (third / "build" / "k.d").read_bytes()
    assert str(third).encode() in restored
    assert str(first).encode() not in restored
    subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-cubin",
            f"-I{third}/include",
            str(third / "src" / "k.cu"),
            "-o",
            "plain.cubin",
            "-MD",
            "-MT",
            "k.cubin",
            "-MF",
            "plain.d",
        ],
        check=True,
        capture_output=True,
    )
    assert restored == (third / "build" / "plain.d").read_bytes()


# Pass-through ------------------------------------------------------------------


UNCACHEABLE = [
    pytest.param(["k.o", "-o", "app"], "not a -c", id="link"),
    pytest.param(["-c", "a.cu", "b.cu"], "2 input files", id="two-inputs"),
    pytest.param(["-E", "k.cu"], "preprocessing", id="preprocess"),
    pytest.param(["--dryrun", "-c", "k.cu", "-o", "k.o"], "--dryrun", id="dryrun"),
    pytest.param(["-v", "-c", "k.cu", "-o", "k.o"], "--verbose", id="verbose"),
    pytest.param(
        ["-c", "k.cu", "-o", "k.o", "-fancy-flag"], "unknown option -fancy-flag", id="unknown"
    ),
    pytest.param(
        ["-forward-unknown-to-host-compiler", "-c", "k.cu", "-save-temps=obj"],
        "-save-temps",
        id="forwarded-host-option-that-writes-files",
    ),
    pytest.param(
        ["-forward-unknown-to-host-compiler", "-c", "k.cu", "-MQ", "x"],
        "-MQ",
        id="forwarded-dependency-option",
    ),
    pytest.param(["-c", "k.cu", "-o", "k.o", "--keep"], "intermediate", id="keep"),
    pytest.param(["-M", "k.cu"], "-M", id="deps-only"),
    pytest.param(["-lib", "k.cu", "-o", "k.a"], "library", id="lib"),
    pytest.param(
        ["-c", "k.cu", "-o", "k.o", "--options-file", "missing.rsp"], "options file", id="optfile"
    ),
    pytest.param(["-c", "-ptx", "k.cu", "-o", "k.o"], "more than one", id="two-modes"),
    pytest.param(["-c", "k.o", "-o", "x.o"], "not a CUDA", id="object-input"),
]


@pytest.mark.parametrize(("args", "reason"), UNCACHEABLE)
def test_uncacheable_reasons(args: list[str], reason: str) -> None:
    inv = nvcc_args.parse(args, environ={})
    assert inv.reason is not None
    assert reason in inv.reason


def test_cacheable_parse(tmp_path: Path) -> None:
    rsp = tmp_path / "includes.rsp"
    rsp.write_text("-I/opt/include -DFROM_RSP")
    inv = nvcc_args.parse(
        [
            "-forward-unknown-to-host-compiler",
            "--options-file",
            str(rsp),
            "-O3",
            "-Xcompiler=-fPIC",
            "--generate-code=arch=compute_90,code=[compute_90,sm_90]",
            "-MD",
            "-MT",
            "t.o",
            "-MF",
            "t.o.d",
            "-x",
            "cu",
            "-c",
            "k.cu",
            "-o",
            "t.o",
        ],
        environ={},
    )
    assert inv.reason is None
    assert (inv.mode, inv.source, inv.output, inv.depfile, inv.deptarget) == (
        "c",
        "k.cu",
        "t.o",
        "t.o.d",
        True,
    )
    assert ["--include-path", "/opt/include"] in inv.keyed
    assert [
        "--define-macro",
        "FROM_RSP",
    ] in inv.keyed
    assert not any("t.o.d" in str(k) for k in inv.keyed), "output paths are not keyed"


def test_uncacheable_call_runs_nvcc_unchanged(
    workspace: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert launch(["nvcc", "--version"]) == (0, "uncacheable")
    assert "Cuda compilation tools" in capfd.readouterr().out
    assert launcher_stats()["reasons"]["--version"] >= 1


def test_failed_compiles_pass_through_and_are_not_cached(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    root = workspace / "broken"
    root.mkdir()
    (root / "bad.cu").write_text("__global__ void k() { not_declared(); }\n")
    settle()
    monkeypatch.chdir(root)
    argv = ["nvcc", "-arch=sm_90", "-cubin", "bad.cu", "-o", "bad.cubin"]
    for _ in range(2):
        rc, outcome = launch(argv)
        assert rc != 0
        assert outcome == "failed"
        assert "not_declared" in capfd.readouterr().err
    assert not (root / "bad.cubin").exists()


def test_compiler_path_in_first_position(
    warm_project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CMake runs ``kernelcache /path/to/nvcc ...``."""
    from kernelcache.__main__ import main as cli

    monkeypatch.chdir(warm_project)
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    before = launcher_stats()["hits"]
    assert cli([nvcc, *BASE[1:]]) == 0
    assert launcher_stats()["hits"] == before + 1


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"KERNELCACHE_MAX_SIZE": "lots"}, id="bad-setting"),
        pytest.param({"KERNELCACHE_DIR": "<file>"}, id="cache-dir-is-a-file"),
    ],
)
def test_an_unusable_cache_never_fails_the_build(
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    env: dict[str, str],
) -> None:
    root = make_project(tmp_path / "p")
    monkeypatch.chdir(root)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    for name, value in env.items():
        monkeypatch.setenv(name, str(blocker) if value == "<file>" else value)
    assert main(["nvcc", "-arch=sm_90", "-ptx", "k.cu", "-o", "k.ptx"]) == 0
    assert (root / "k.ptx").stat().st_size > 100
    assert "cache unavailable" in capfd.readouterr().err


def test_kernelcache_stats_reports_the_launcher(warm_project: Path, workspace: Path) -> None:
    import json
    import subprocess
    import sys

    assert launch(["nvcc", "--version"]) == (0, "uncacheable")
    cmd = [sys.executable, "-m", "kernelcache", "--dir", str(workspace / "cache"), "stats"]
    report = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, check=True).stdout)
    launcher = report["nvcc_launcher"]
    assert launcher["hits"] >= 1
    assert launcher["misses"] >= 1
    assert launcher["reasons"]["--version"] >= 1
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "nvcc launcher (lifetime): hits" in text
    assert "--version" in text


def test_debug_info_shares_across_checkouts_only_when_asked(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-lineinfo names the directory: keyed by default; KERNELCACHE_HASH_DIR=0 shares it.

    Shared, the restored object names the first checkout (as with ccache's
    hash_dir = false): that is the documented price.
    """
    first = make_project(workspace / "debug" / "one")
    second = workspace / "debug" / "two"
    shutil.copytree(first, second)
    settle()
    argv = ["nvcc", "-arch=sm_90", "-lineinfo", "-cubin", "k.cu", "-o", "k.cubin"]
    monkeypatch.chdir(first)
    assert launch(argv) == (0, "misses")
    assert str(first).encode() in (first / "k.cubin").read_bytes()
    monkeypatch.chdir(second)
    assert launch(argv) == (0, "misses"), "the directory is keyed when debug info names it"
    monkeypatch.setenv("KERNELCACHE_HASH_DIR", "0")
    monkeypatch.chdir(first)
    assert launch(argv) == (0, "misses")  # a new key, without the directory
    monkeypatch.chdir(second)
    assert launch(argv) == (0, "hits")
    restored = (second / "k.cubin").read_bytes()
    assert str(first).encode() in restored
    assert str(second).encode() not in restored


def test_a_bad_launcher_setting_never_fails_the_build(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(make_project(workspace / "badflag"))
    monkeypatch.setenv("KERNELCACHE_HASH_DIR", "sometimes")
    assert main(["nvcc", "-arch=sm_90", "-ptx", "k.cu", "-o", "k.ptx"]) == 0
    assert "KERNELCACHE_HASH_DIR" in capfd.readouterr().err


def test_server_identities_follow_a_wrapper_scripts_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server remembers toolchain identities, re-checked by stat: a new target is seen."""
    from kernelcache import toolchain
    from kernelcache.nvcc.key import Identities

    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    real = tmp_path / "real-cc"
    real.write_text("#!/bin/sh\necho 'cc 1.0'\n")
    real.chmod(0o755)
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    time.sleep(2.1)  # older than _fs.TOO_NEW_NS: stats may vouch for them
    probed: list[str] = []
    probe = toolchain.executable

    def counting(path: str) -> str:
        probed.append(path)
        return probe(path)

    monkeypatch.setattr(toolchain, "executable", counting)
    known = Identities()
    first = known.executable(str(wrapper))
    assert known.executable(str(wrapper)) == first
    assert len(probed) == 1  # remembered
    real.write_text("#!/bin/sh\necho 'cc 2.0'\n")  # the target changes, the wrapper does not
    assert known.executable(str(wrapper)) != first
    assert len(probed) == 2


def test_large_outputs_are_stored_compressed(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("zstandard")
    from kernelcache.cache import Cache
    from kernelcache.nvcc import deps as nvcc_deps
    from kernelcache.nvcc.job import Job

    root = workspace / "large"
    root.mkdir()
    (root / "big.cu").write_text(
        "__device__ int table[65536] = {1, 2, 3};\n"
        "__global__ void k(int* x) { x[threadIdx.x] = table[threadIdx.x]; }\n"
    )
    settle()
    monkeypatch.chdir(root)
    argv = ["nvcc", "-arch=sm_90", "-cubin", "big.cu", "-o", "big.cubin"]
    assert launch(argv) == (0, "misses")
    cold = (root / "big.cubin").read_bytes()
    assert len(cold) > 256 << 10
    with Cache() as cache:
        job = Job.prepare(shutil.which("nvcc") or "nvcc", nvcc_args.parse(argv[1:]), os.environ)
        manifest = cache.get(job.direct)
        result = cache.get(str(nvcc_deps.variants(manifest)[0]["result"]))
        assert result is not None
        assert result.meta["output_codec"] == "zstd"
        assert len(result["output"]) < len(cold) // 10
    (root / "big.cubin").unlink()
    assert launch(argv) == (0, "hits")
    assert (root / "big.cubin").read_bytes() == cold
    plain = subprocess.run(["nvcc", *argv[1:-1], "plain.cubin"], check=True, capture_output=True)
    assert plain.returncode == 0
    assert (root / "plain.cubin").read_bytes() == cold


@pytest.mark.parametrize(
    ("meta", "error"),
    [
        pytest.param(
            {"output_codec": "zstd", "output_size": 10}, "wrong size", id="declared-too-small"
        ),
        pytest.param(
            {"output_codec": "zstd", "output_size": 1 << 30}, "wrong size", id="declared-too-large"
        ),
        pytest.param(
            {"output_codec": "lz4", "output_size": 100}, "unknown output", id="unknown-codec"
        ),
    ],
)
def test_a_compressed_output_is_bounded_by_its_declared_size(
    meta: dict[str, object], error: str
) -> None:
    zstandard = pytest.importorskip("zstandard")
    from kernelcache.entry import Entry
    from kernelcache.nvcc.outputs import unpack_output

    frame = zstandard.ZstdCompressor().compress(b"x" * 100_000)
    with pytest.raises(ValueError, match=error):
        unpack_output(Entry({"output": frame}, meta))
