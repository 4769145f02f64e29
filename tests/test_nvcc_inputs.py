"""Issue 19: every input nvcc reads is in the launcher's key, or the call is not cached.

Each test warms the cache, changes one input (an environment variable that
``nvcc.profile`` reads, a host option given through ``-Xcompiler``, a header
reached by an unusual spelling, a time macro) and checks that what
``kernelcache nvcc`` returns is what a fresh nvcc compile under the same
inputs returns: output bytes and stderr alike.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kernelcache.nvcc.launcher import launcher_stats, main
from launcher_env import without_file_symbol

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

#: A kernel whose device code, host code and warnings depend on FOO.
KERNEL = """#ifndef FOO
#define FOO 1
#endif
__global__ void k(float* y) { int unused_on_purpose; y[threadIdx.x] = FOO * 3.0f; }
int host_value() { return FOO; }
"""
CUBIN = ["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]
OBJECT = ["nvcc", "-arch=sm_90", "-c", "k.cu", "-o", "k.cubin"]


def settle() -> None:
    """Let file timestamps fall behind the next compile's start (nvcc_deps.RACE_SLOP_NS)."""
    time.sleep(0.05)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project with a cache of its own, as the working directory."""
    root = tmp_path / "project"
    root.mkdir()
    monkeypatch.setenv("KERNELCACHE_DIR", str(tmp_path / "cache"))
    for name in (
        "KERNELCACHE_BASEDIR",
        "KERNELCACHE_SLOPPINESS",
        "NVCC_APPEND_FLAGS",
        "NVCC_PREPEND_FLAGS",
        "NVCC_CCBIN",
        "INCLUDES",
        "SYSTEM_INCLUDES",
        "PTXAS_FLAGS",
        "CUDAFE_FLAGS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(root)
    return root


def _mask(data: bytes) -> bytes:
    return without_file_symbol(data)


def cached(
    argv: list[str], capfd: pytest.CaptureFixture[str], env: dict[str, str] | None = None
) -> tuple[str, bytes, str]:
    """``kernelcache nvcc ARGV`` in this process: the event counted, the output, stderr."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        before = launcher_stats()
        capfd.readouterr()
        assert main(argv) == 0
        err = capfd.readouterr().err
        after = launcher_stats()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    events = [k for k in ("hits", "misses", "uncacheable") if after.get(k, 0) != before.get(k, 0)]
    assert len(events) == 1, (before, after)
    return events[0], _mask(Path("k.cubin").read_bytes()), err


def fresh(argv: list[str], env: dict[str, str] | None = None) -> tuple[bytes, str]:
    """Plain nvcc under the same inputs, into another file: its output and stderr.

    A test asks twice under unchanged inputs (a miss, then the hit): the second
    answer is the first one's, keyed by the command, the whole environment and
    every file of the test's directory (so about 1 nvcc run in 6 is saved, and
    nothing a test changes can be missed).
    """
    args = [("fresh.out" if a == "k.cubin" else a) for a in argv]
    full_env = {**os.environ, **(env or {})}
    inputs = (tuple(args), tuple(sorted(full_env.items())), _snapshot(Path.cwd().parent))
    if inputs not in _FRESH:
        proc = subprocess.run(args, env=full_env, capture_output=True, check=True)
        _FRESH.clear()  # one test's answers only: tmp_path is the test's own
        _FRESH[inputs] = (_mask(Path("fresh.out").read_bytes()), proc.stderr.decode())
    return _FRESH[inputs]


_FRESH: dict[object, tuple[bytes, str]] = {}
_OUTPUTS = {"k.cubin", "fresh.out"}


def _snapshot(root: Path) -> tuple[tuple[str, object], ...]:
    """Every file under the test's directory but the cache and the outputs: small ones by
    content, large ones (a copied nvcc) by size and mtime, links by target."""
    rows: list[tuple[str, object]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (folder == str(root) and d == "cache")]
        for name in files:
            if name in _OUTPUTS:
                continue
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if os.path.islink(path):
                rows.append((path, os.readlink(path)))
            elif st.st_size <= 1 << 16:
                rows.append((path, Path(path).read_bytes()))
            else:
                rows.append((path, (st.st_size, st.st_mtime_ns)))
    return tuple(sorted(rows, key=lambda row: row[0]))


def same_as_fresh(
    argv: list[str], capfd: pytest.CaptureFixture[str], env: dict[str, str] | None = None
) -> str:
    """Run through the cache, compare with a fresh compile, return the event."""
    event, output, err = cached(argv, capfd, env)
    expected, expected_err = fresh(argv, env)
    assert output == expected, f"{event}: a binary that differs from a fresh compile"
    assert err.replace("kernelcache", "") == expected_err.replace("kernelcache", "")
    return event


# 1. The environment nvcc.profile reads ------------------------------------------


PROFILE_ENV = [
    pytest.param(CUBIN, {"INCLUDES": "-DFOO=7"}, id="INCLUDES"),
    pytest.param(CUBIN, {"SYSTEM_INCLUDES": "-DFOO=9"}, id="SYSTEM_INCLUDES"),
    pytest.param(CUBIN, {"PTXAS_FLAGS": "-O0"}, id="PTXAS_FLAGS"),
    pytest.param(CUBIN, {"CUDAFE_FLAGS": "--diag_suppress=177"}, id="CUDAFE_FLAGS-stderr"),
    pytest.param(OBJECT, {"INCLUDES": "-DFOO=5"}, id="INCLUDES-object"),
]


@pytest.mark.parametrize(("argv", "env"), PROFILE_ENV)
def test_profile_variables_are_keyed(
    project: Path, capfd: pytest.CaptureFixture[str], argv: list[str], env: dict[str, str]
) -> None:
    (project / "k.cu").write_text(KERNEL)
    settle()
    assert same_as_fresh(argv, capfd) == "misses"
    assert same_as_fresh(argv, capfd, env) == "misses"
    assert same_as_fresh(argv, capfd, env) == "hits"


def test_the_preprocessed_key_holds_them_too(
    project: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A comment-only edit goes to the preprocessed key; PTXAS_FLAGS must still tell them apart."""
    (project / "k.cu").write_text(KERNEL)
    settle()
    assert same_as_fresh(CUBIN, capfd) == "misses"
    (project / "k.cu").write_text(KERNEL + "// a comment\n")
    settle()
    assert same_as_fresh(CUBIN, capfd, {"PTXAS_FLAGS": "-O0"}) == "misses"


@pytest.fixture
def own_nvcc(tmp_path: Path) -> str:
    """nvcc run through a symlink whose directory holds a profile reading a variable of its own.

    nvcc reads the profile next to the path it was run by, not next to its
    real binary; the real binary's directory here holds a decoy profile.
    """
    real = Path(os.path.realpath(shutil.which("nvcc") or ""))
    if not (real.parent / "nvcc.profile").is_file():  # a wrapper script: its exec'd nvcc
        real = next(
            Path(p) for p in real.read_text(errors="replace").split() if p.endswith("/nvcc")
        )
    toolkit = real.parent.parent
    profile = (real.parent / "nvcc.profile").read_text()
    profile = profile.replace("$(_HERE_)/..", str(toolkit)).replace("$(_HERE_)", str(real.parent))
    # nvcc finds its target directory next to itself; this copy is elsewhere.
    targets = next((toolkit / "targets").iterdir()).relative_to(toolkit)
    profile = profile.replace("$(_TARGET_DIR_)", str(targets))
    bindir = tmp_path / "toolkit-bin"
    bindir.mkdir()
    shutil.copy2(real, bindir / "nvcc")
    (bindir / "nvcc.profile").write_text(profile)  # the decoy
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(bindir / "nvcc")
    knob = "\nINCLUDES += $(KERNELCACHE_TEST_KNOB) $(_SPACE_)\n"
    (link.parent / "nvcc.profile").write_text(profile + knob)
    return str(link)


def test_a_variable_only_this_profile_reads(
    project: Path, capfd: pytest.CaptureFixture[str], own_nvcc: str
) -> None:
    (project / "k.cu").write_text(KERNEL)
    settle()
    argv = [own_nvcc, *CUBIN[1:]]
    assert same_as_fresh(argv, capfd) == "misses"
    knob = {"KERNELCACHE_TEST_KNOB": "-DFOO=4"}
    assert same_as_fresh(argv, capfd, knob) == "misses"
    assert same_as_fresh(argv, capfd, {"KERNELCACHE_TEST_KNOB": "-DFOO=6"}) == "misses"
    assert same_as_fresh(argv, capfd, knob) == "hits"


# 2. Host options through -Xcompiler ---------------------------------------------


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param(["-Xcompiler", "@opts"], id="Xcompiler"),
        pytest.param(["--compiler-options", "@opts"], id="compiler-options"),
        pytest.param(["-Xcompiler=@opts"], id="Xcompiler="),
        pytest.param(["-Xcompiler", "-Wall,@opts"], id="comma-list"),
        pytest.param(["-Xcompiler", "@outer"], id="nested-response-file"),
    ],
)
def test_host_response_files_are_keyed_by_content(
    project: Path, capfd: pytest.CaptureFixture[str], spelling: list[str]
) -> None:
    (project / "k.cu").write_text(KERNEL)
    (project / "outer").write_text("-Wextra @opts\n")
    (project / "opts").write_text("-DFOO=2\n")
    settle()
    argv = [*OBJECT, *spelling]
    assert same_as_fresh(argv, capfd) == "misses"
    (project / "opts").write_text("-DFOO=3\n")
    settle()
    assert same_as_fresh(argv, capfd) == "misses"
    assert same_as_fresh(argv, capfd) == "hits"


def test_a_header_only_the_device_pass_reads_is_keyed(
    project: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Direct mode trusts nvcc's dependency list; it must name what the sm_90 device pass
    alone includes (nvcc 13's ``-MD`` does: its list covers every preprocessor pass)."""
    guard = '#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n#include "dev.h"\n#endif\n'
    (project / "k.cu").write_text(guard + KERNEL)
    (project / "dev.h").write_text("#define FOO 2\n")
    settle()
    assert same_as_fresh(CUBIN, capfd) == "misses"
    assert same_as_fresh(CUBIN, capfd) == "hits"
    (project / "dev.h").write_text("#define FOO 5\n")
    settle()
    assert same_as_fresh(CUBIN, capfd) == "misses"
    assert same_as_fresh(CUBIN, capfd) == "hits"


def test_a_pre_included_host_header_is_keyed_by_content(
    project: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (project / "k.cu").write_text(KERNEL)
    (project / "pre.h").write_text("#define FOO 2\n")
    settle()
    argv = [*OBJECT, "-Xcompiler", "-include,pre.h"]
    assert same_as_fresh(argv, capfd) == "misses"
    (project / "pre.h").write_text("#define FOO 8\n")
    settle()
    assert same_as_fresh(argv, capfd) == "misses"


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param(["-Xcompiler", "-specs=my.specs"], id="specs"),
        pytest.param(["--compiler-options=-B/usr/bin/"], id="B"),
        pytest.param(["-Xcompiler", "-O2,-fprofile-use=k.prof"], id="fprofile-use"),
        pytest.param(["-Xcompiler=@missing-file"], id="unreadable-response-file"),
        pytest.param(["-Xcompiler", "@bad"], id="response-file-naming-specs"),
    ],
)
def test_host_options_refused_elsewhere_are_refused_here(
    project: Path, spelling: list[str]
) -> None:
    (project / "k.cu").write_text(KERNEL)
    (project / "my.specs").write_text("")
    (project / "bad").write_text("-specs=my.specs\n")
    before = launcher_stats().get("uncacheable", 0)
    main([*OBJECT, *spelling])  # nvcc runs unchanged; it may or may not like the option
    assert launcher_stats().get("uncacheable", 0) == before + 1


# 3. Headers reached by any spelling: failed lookups are watched, or no direct mode --------


SPELLINGS = [
    pytest.param("#/**/include <inc.h>\n", "inc.h", id="comment-after-hash"),
    pytest.param("%:include <inc.h>\n", "inc.h", id="digraph"),
    pytest.param("#inc\\\nlude <inc.h>\n", "inc.h", id="splice"),
    pytest.param("#define H <inc.h>\n#include H\n", "inc.h", id="computed-include"),
    pytest.param(  # the only mention of extra.h: creating it changes FOO
        "#define H <extra.h>\n#if __has_include(H)\n#define FOO 5\n#endif\n",
        "extra.h",
        id="has-include-macro",
    ),
]


@pytest.mark.parametrize(("spelling", "created"), SPELLINGS)
def test_a_header_created_earlier_in_the_search_path(
    project: Path, capfd: pytest.CaptureFixture[str], spelling: str, created: str
) -> None:
    """``-Ia -Ib`` with inc.h only in b/: creating a/inc.h (or a/extra.h) changes the compile."""
    (project / "a").mkdir()
    (project / "b").mkdir()
    (project / "b" / "inc.h").write_text("#define FOO 2\n")
    (project / "k.cu").write_text(spelling + KERNEL)
    settle()
    argv = [*CUBIN, "-Ia", "-Ib"]
    assert same_as_fresh(argv, capfd) == "misses"
    assert same_as_fresh(argv, capfd) == "hits"
    (project / "a" / created).write_text("#define FOO 3\n" if created == "inc.h" else "\n")
    settle()
    assert same_as_fresh(argv, capfd) == "misses"


def test_include_next_spelled_with_a_comment(
    project: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    for d in "abcd":
        (project / d).mkdir()
    (project / "b" / "inc.h").write_text("#/**/include_next <inc.h>\n")
    (project / "d" / "inc.h").write_text("#define FOO 2\n")
    (project / "k.cu").write_text("#include <inc.h>\n" + KERNEL)
    settle()
    argv = [*CUBIN, "-Ia", "-Ib", "-Ic", "-Id"]
    assert same_as_fresh(argv, capfd) == "misses"
    (project / "c" / "inc.h").write_text("#define FOO 3\n")
    settle()
    assert same_as_fresh(argv, capfd) == "misses"


# 5. Time macros: one rule with NVRTC and cuda.core ----------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("const char* t = __TI\\\nME__;\n", id="spliced-time"),
        pytest.param("const char* d = __DA\\\nTE__;\n", id="spliced-date"),
        pytest.param("const char* s = __TIMESTAMP__;\n", id="timestamp"),
    ],
)
def test_time_macros_are_not_cached_unless_allowed(
    project: Path, capfd: pytest.CaptureFixture[str], text: str
) -> None:
    (project / "k.cu").write_text(text + KERNEL)
    settle()
    assert cached(CUBIN, capfd)[0] == "uncacheable"
    assert cached(CUBIN, capfd)[0] == "uncacheable"
    allowed = {"KERNELCACHE_SLOPPINESS": "time_macros"}
    assert cached(CUBIN, capfd, allowed)[0] == "misses"
    assert cached(CUBIN, capfd, allowed)[0] == "hits"


def test_host_search_options_join_the_watched_search_path(project: Path) -> None:
    from kernelcache.nvcc.args import parse

    (project / "opts").write_text("-isystem sys -iquote q\n")
    inv = parse(
        [
            *["-c", "k.cu", "-Xcompiler", "-I,a,-Ib,@opts", "--compiler-options=-idirafter,z"],
            *["-Xcompiler", "-include,f.h,-imacrosm.h", "-include", "p.h,r.h"],
        ]
    )
    assert inv.reason is None
    assert inv.includes == [
        ("include", "a"),
        ("include", "b"),
        ("isystem", "sys"),
        ("quote", "q"),
        ("isystem", "z"),
        ("pre", "f.h"),
        ("pre", "m.h"),
        ("pre", "p.h"),
        ("pre", "r.h"),
    ]


def test_response_files_nested_too_deeply_are_refused(project: Path) -> None:
    from kernelcache.nvcc.args import parse

    (project / "loop").write_text("@loop\n")
    assert "nested too deeply" in (parse(["-c", "k.cu", "-Xcompiler", "@loop"]).reason or "")


# 4. Every other lookup along a search path (issue 40) ----------------------------------

#: (extra arguments, first lines of k.cu, the header as found, the header created later).
SHADOWED = [
    pytest.param(["-Xcompiler", "-include,h.h"], "", "b/h.h", "a/h.h", id="Xcompiler-include"),
    pytest.param(["-Xcompiler=-include,h.h"], "", "b/h.h", "a/h.h", id="Xcompiler=-include"),
    pytest.param(["--compiler-options=-includeh.h"], "", "b/h.h", "h.h", id="host-include-joined"),
    pytest.param(["-Xcompiler", "-imacros,h.h"], "", "b/h.h", "a/h.h", id="Xcompiler-imacros"),
    pytest.param(["-include", "h.h"], "", "b/h.h", "a/h.h", id="nvcc-include"),
    pytest.param(["--pre-include=h.h"], "", "b/h.h", "h.h", id="pre-include-cwd"),
    # -w: the launcher's -MD pass would repeat gcc's "#include_next in primary source file"
    pytest.param(
        ["-Xcompiler", "-w"], '#include_next "h.h"\n', "b/h.h", "a/h.h", id="next-in-main"
    ),
    pytest.param(
        ["-Xcompiler", "-w"], '#include_next "h.h"\n', "b/h.h", "h.h", id="next-beside-main"
    ),
    pytest.param(["-Xcompiler", "-iquote,q"], '#include "h.h"\n', "a/h.h", "q/h.h", id="iquote"),
    pytest.param(["-Xcompiler", "-Ib"], "#include <h.h>\n", "a/h.h", "b/h.h", id="host-I-first"),
    pytest.param(
        ["-Xcompiler", "-idirafter,z", "-isystem", "s"],
        "#include <h.h>\n",
        "z/h.h",
        "s/h.h",
        id="idirafter-after-isystem",
    ),
    pytest.param(
        ["-Xcompiler", "-isystem,s"], "#include <h.h>\n", "s/h.h", "a/h.h", id="host-isystem"
    ),
    pytest.param(
        [],
        "",
        None,
        "cuda_runtime.h",
        id="nvcc-own-pre-include",
    ),
]


@pytest.mark.parametrize(("extra", "head", "found", "created"), SHADOWED)
def test_a_header_created_earlier_along_any_lookup(
    project: Path,
    capfd: pytest.CaptureFixture[str],
    extra: list[str],
    head: str,
    found: str | None,
    created: str,
) -> None:
    """``-Ia -Ib`` and a header found late in the compiler's search: creating one where the
    compiler looks first (as gcc orders ``-iquote``, ``-I``, ``-isystem``, ``-idirafter``,
    host options before nvcc's; the working directory first for ``-include``) is a miss,
    and the result is plain nvcc's."""
    for d in ("a", "b", "q", "s", "z"):
        (project / d).mkdir()
    if found is not None:
        (project / found).write_text("#define FOO 2\n")
    (project / "k.cu").write_text(head + KERNEL)
    settle()
    argv = [*CUBIN, "-Ia", "-Ib", *extra]
    assert same_as_fresh(argv, capfd) == "misses"
    assert same_as_fresh(argv, capfd) == "hits"
    shadow = "#include_next <cuda_runtime.h>\n" if created == "cuda_runtime.h" else ""
    (project / created).write_text(shadow + "#define FOO 3\n")
    settle()
    assert same_as_fresh(argv, capfd) == "misses"
    assert same_as_fresh(argv, capfd) == "hits"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        pytest.param(["-Xcompiler", "-iwithprefix,x"], {}, id="iwithprefix"),
        pytest.param(["-Xcompiler", "-iprefix,p/"], {}, id="iprefix"),
        pytest.param(
            ["-Xcompiler", "-isystem", "-Xcompiler", "s"], {}, id="value-in-next-Xcompiler"
        ),
        pytest.param(["-Xcompiler", "-I=/usr/include"], {}, id="sysroot-relative"),
        pytest.param([], {"INCLUDES": "-DX=1 -Ienvinc"}, id="profile-INCLUDES"),
        pytest.param([], {"SYSTEM_INCLUDES": "'-isystem"}, id="profile-unreadable"),
    ],
)
def test_a_search_the_scanner_does_not_model_gets_no_direct_mode(
    project: Path, argv: list[str], env: dict[str, str]
) -> None:
    """Found by the preprocessed key only (:class:`Unsure`), never through the manifest."""
    from kernelcache.nvcc import includes
    from kernelcache.nvcc.args import parse

    inv = parse(["-c", "k.cu", *argv])
    assert inv.reason is None
    with pytest.raises(includes.Unsure):
        includes.absent({}, includes.search_path(inv, env), 0)
    defines = {"INCLUDES": "-DEXTRA=1", "SYSTEM_INCLUDES": "-UFOO"}
    assert includes.search_path(parse(["-c", "k.cu"]), defines).unsure is None
