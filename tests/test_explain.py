"""Keys that explain themselves: records, differences in words, and ``kernelcache explain``
after one real change per integration family (issue 38)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest

from cli_run import kc, kc_json
from kernelcache import keys
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.explain import fields, recent_misses, record, words
from kernelcache.keys import KeyBuilder, encode
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore

# Records and words (no compiler) ---------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(None, id="none"),
        pytest.param(True, id="bool"),
        pytest.param(-(2**70), id="big-int"),
        pytest.param(-0.0, id="float"),
        pytest.param("ünï", id="str"),
        pytest.param(b"\x00\xff", id="bytes"),
        pytest.param([1, ["a", None], {"k": 2.5}], id="nested"),
    ],
)
def test_decode_gives_back_what_was_encoded(value: Any) -> None:
    assert encode(fields.decode(encode(value))) == encode(value)


def test_decode_refuses_what_encode_never_wrote() -> None:
    with pytest.raises(ValueError, match="unknown tag"):
        fields.decode(b"X")
    with pytest.raises(ValueError, match="trailing"):
        fields.decode(encode(1) + b"N")


def test_a_record_flattens_nested_keys_dicts_and_file_rows() -> None:
    inner = KeyBuilder("t.inner").add("tool", "nvcc 13.0").add("args", ["-O3"]).hexdigest()
    key = (
        KeyBuilder("t.outer")
        .add("command", inner)
        .add("env", {"CPATH": None, "HOME_SECRET": "x"})
        .add("included", [["inc", "a.cuh", b"\x01" * 32], ["inc", "b.cuh", b"\x02" * 32]])
        .add("api_token", "hunter2")
        .add("defines", ["-O3", "-DAPI_TOKEN=hunter2"])
        .add("source", "x" * 1000)
        .hexdigest()
    )
    got = {f[0]: f[2:] for f in fields.summary(key)["fields"]}  # type: ignore[index]
    assert got == {
        "command.tool": ["nvcc 13.0"],
        "command.args": [["-O3"]],
        "env.CPATH": [None],
        "env.HOME_SECRET": [],  # a secret's value is never kept
        "included[inc/a.cuh]": [],
        "included[inc/b.cuh]": [],
        "api_token": [],
        "defines": [],  # a value that reads like a secret: a digest only (it goes to the team)
        "source": [],  # too large: a digest only
    }
    assert fields.summary("0" * 64) is None  # not built here


def test_an_opaque_field_explained_by_its_parts() -> None:
    # Another tool's hash in the key: what it was made of, noted beside it.
    key = KeyBuilder("kernelcache.t").add("file", ("group", "9f" * 32, "k.json")).hexdigest()
    fields.note_fields(key, {"options": {"num_warps": 4}, "env": {"TRITON_DEBUG": None}}, ("file",))
    got = {f[0]: f[2:] for f in fields.summary(key)["fields"]}  # type: ignore[index]
    assert got == {"options.num_warps": [4], "env.TRITON_DEBUG": [None]}
    other = KeyBuilder("kernelcache.t").add("file", ("group", "8e" * 32, "k.json")).hexdigest()
    fields.note_fields(
        other, {"options": {"num_warps": 8}, "env": {"TRITON_DEBUG": None}}, ("file",)
    )
    said = words.differences(fields.summary(other), fields.summary(key))  # type: ignore[arg-type]
    assert [d["words"] for d in said] == ["`options.num_warps`: 4 → 8"]
    with pytest.raises(TypeError, match="cannot use a value"):
        fields.note_fields(key, {"bad": object()})


@pytest.mark.parametrize(
    ("namespace", "family"),
    [
        pytest.param("kernelcache.nvcc.direct", "nvcc", id="launcher"),
        pytest.param("kernelcache.nvrtc", "nvrtc", id="nvrtc"),
        pytest.param("jax/1", "jax", id="jax"),
        pytest.param("my-dsl", "my_dsl", id="other"),
    ],
)
def test_keys_are_grouped_by_integration_family(namespace: str, family: str) -> None:
    assert keys.family(namespace) == family
    assert keys.family_of(KeyBuilder(namespace).add("x", 1).hexdigest()) == family
    assert keys.family_of("0" * 64) == "other"


def test_records_do_not_change_keys() -> None:
    # The digests keys had before they kept records (existing entries stay valid).
    builder = KeyBuilder("kernelcache.nvrtc").add("arch", "sm_90").add("options", ["-G"])
    key = builder.hexdigest()
    assert key == "4ce2269f9e8bc17b64bf3416dda934ccd6221dbac1069b9118eb19e77b0e7386"
    more = builder.copy().add("x", {"a": [1, None, b"z"]}).hexdigest()
    assert more == "533a12253c1664ca126ee77fc9fdd313de43f3fdb9e2485c8406dde8fa5fd0af"
    assert keys.built(key) == (
        "kernelcache.nvrtc",
        (("arch", encode("sm_90")), ("options", encode(["-G"]))),
    )
    assert len(keys.built(more)[1]) == 3  # type: ignore[index]
    assert builder.hexdigest() == key  # the copy's field did not reach the original


def _rec(*fields_: list[Any]) -> dict[str, Any]:
    return {"ns": "t", "fields": [list(f) for f in fields_]}


@pytest.mark.parametrize(
    ("new", "old", "said"),
    [
        pytest.param(
            ["command.nvcc", "b", "nvcc\nCuda compilation tools, release 13.1, V13.1.12"],
            ["command.nvcc", "a", "nvcc\nCuda compilation tools, release 13.0, V13.0.88"],
            "nvcc: Cuda compilation tools, release 13.0, V13.0.88 → "
            "Cuda compilation tools, release 13.1, V13.1.12",
            id="version",
        ),
        pytest.param(
            ["input[common.cuh]", "c3d4e5"],
            ["input[common.cuh]", "a1b2c3"],
            "header `common.cuh` changed (digest a1b2 → c3d4)",
            id="header",
        ),
        pytest.param(
            ["command.args", "b", [["--optimize", "2"]]],
            ["command.args", "a", [["--optimize", "3"]]],
            "flags: --optimize 3 → --optimize 2",
            id="flags",
        ),
        pytest.param(
            ["command.cwd", "b", "/b"],
            ["command.cwd", "a", "/a"],
            "the source's folder (debug info on)",
            id="folder",
        ),
        pytest.param(
            ["command.env.NVCC_APPEND_FLAGS", "b", "-G"],
            ["command.env.NVCC_APPEND_FLAGS", "a", None],
            "environment variable NVCC_APPEND_FLAGS: unset → -G",
            id="env",
        ),
        pytest.param(
            ["xla_flags", "b"],
            ["xla_flags", "a"],
            "JAX: XLA flags changed (digest a → b)",
            id="jax",
        ),
        pytest.param(
            ["input[/usr/include/*]", "b", 3],
            ["input[/usr/include/*]", "a", 3],
            "a header in `/usr/include` changed (digest a → b)",
            id="folder-of-headers",
        ),
    ],
)
def test_a_difference_is_said_in_words(new: list[Any], old: list[Any], said: str) -> None:
    diffs = words.differences(_rec(new, ["same", "x"]), _rec(old, ["same", "x"]))
    assert [d["words"] for d in diffs] == [said]
    assert diffs[0]["label"] == new[0]


def test_files_read_by_one_side_only_follow_from_another_difference() -> None:
    miss = _rec(["args", "b", ["-O2"]], ["input[extra.h]", "e"], ["input[/usr/*]", "u2", 4])
    stored = _rec(["args", "a", ["-O3"]], ["input[/usr/*]", "u1", 3])
    assert [d["label"] for d in words.differences(miss, stored)] == ["args"]
    alone = words.differences(_rec(["input[extra.h]", "e"]), _rec())
    assert [d["words"] for d in alone] == ["header `extra.h`: not in the stored entry's key"]


def test_an_entry_keeps_its_key_record_on_every_tier(tmp_path: Path) -> None:
    key = KeyBuilder("t.tiers").add("arch", "sm_90").hexdigest()
    entry = Entry({"k": b"bin"}, {"name": "k", "compile_seconds": 1.0})
    digest = sha256(encode("sm_90")).hexdigest()[:12]
    with Cache([MemoryStore(), DiskStore(tmp_path / "d")], persist_stats=False) as cache:
        stored = cache.put(key, entry)
        assert stored == entry
        assert stored.meta == entry.meta
        for tier in cache.tiers:
            got = tier.get(key)
            assert got is not None
            assert got.key_record == {"ns": "t.tiers", "fields": [["arch", digest, "sm_90"]]}
    plain = Entry({"k": b"bin"})
    assert plain.key_record is None
    # A key not built by this process: the entry goes in as it is.
    with Cache([MemoryStore()], persist_stats=False) as cache:
        assert cache.put("f" * 64, plain).key_record is None


def test_recent_misses_and_the_filed_last_miss(tmp_path: Path) -> None:
    key = KeyBuilder("kernelcache.demo").add("options", ["-O2"]).hexdigest()
    cache_dir = tmp_path / "c"
    with Cache([DiskStore(cache_dir)]) as cache:
        assert cache.stats_dir is not None
        assert cache.get(key) is None
        assert recent_misses()[-1]["key"] == key
        cache.get_or_compile(key, lambda: Entry({"x": b"1"}, {"name": "n"}))
    filed = record.last_miss(str(cache_dir), "demo")
    assert filed is not None
    assert filed["key"] == key
    assert filed["name"] == "n"
    assert record.last_miss(str(cache_dir), "nvrtc") is None
    with pytest.raises(ValueError, match="unknown integration"):
        record.last_miss(str(cache_dir), "no such/kind")
    (Path(record.last_miss_path(str(cache_dir), "demo"))).write_text("[")
    with pytest.raises(ValueError, match="not a last-miss record"):
        record.last_miss(str(cache_dir), "demo")
    # A FIFO planted in its place is refused at once, never waited on (review).
    filed_path = Path(record.last_miss_path(str(cache_dir), "demo"))
    filed_path.unlink()
    os.mkfifo(filed_path)
    with pytest.raises(ValueError, match="not a regular file"):
        record.last_miss(str(cache_dir), "demo")
    # A directory others may write is not read from.
    explain_dir = filed_path.parent
    explain_dir.chmod(0o777)
    from kernelcache._trust import UntrustedDirectory

    with pytest.raises(UntrustedDirectory):
        record.last_miss(str(cache_dir), "demo")
    explain_dir.chmod(0o700)


def test_explain_a_key_names_the_field_against_the_nearest_entry(tmp_path: Path) -> None:
    cache_dir = tmp_path / "c"
    made = []
    with Cache([DiskStore(cache_dir)]) as cache:
        for opt in ("-O3", "-O2"):
            key = KeyBuilder("kernelcache.demo").add("src", "k").add("options", [opt]).hexdigest()
            cache.put(key, Entry({"x": opt.encode()}, {"name": "k"}))
            made.append(key)
    env = {"KERNELCACHE_DIR": str(cache_dir)}
    report = kc_json("explain", made[1], env=env)
    (near,) = report["nearest"]
    assert near["key"] == made[0]
    assert [d["words"] for d in near["differences"]] == ["flags: -O3 → -O2"]
    text = kc("explain", made[1], env=env)
    assert text.returncode == 0
    assert "flags: -O3 → -O2" in text.stdout
    unknown = kc("explain", "e" * 64, env=env)
    assert unknown.returncode == 1
    assert "no entry with its key's fields" in unknown.stdout
    nothing = kc("explain", "--last-miss", "triton", env=env)
    assert nothing.returncode == 1
    assert "no miss of triton recorded" in nothing.stdout
    assert kc("explain", env=env).returncode == 2
    assert kc("explain", "--last-miss", "nvcc", made[0], env=env).returncode == 2


# The launcher ------------------------------------------------------------------

NVCC = shutil.which("nvcc")
KERNEL = '#include "common.cuh"\n__global__ void k(float* x) { x[threadIdx.x] *= SCALE; }\n'
COMMON = "#pragma once\n#define SCALE 2.0f\n"


def _project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "k.cu").write_text(KERNEL)
    (root / "common.cuh").write_text(COMMON)
    old = time.time() - 3600
    for path in root.iterdir():
        os.utime(path, (old, old))
    time.sleep(0.05)  # the change times fall behind the compile's start (nvcc_deps.RACE_SLOP_NS)
    return root


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache holding one compile of k.cu; each test compiles one change in a folder of its own."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    from kernelcache.nvcc.launcher import main

    root = tmp_path_factory.mktemp("explain-nvcc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCACHE_DIR", str(root / "cache"))
        for name in ("KERNELCACHE_BASEDIR", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "CPATH"):
            mp.delenv(name, raising=False)
        mp.chdir(_project(root / "base"))
        assert main(["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]) == 0
        yield root


def _fake_nvcc(where: Path) -> str:
    """nvcc behind a wrapper that says another release (a toolchain upgrade, as keys see it).

    It runs the real nvcc (not a wrapper of it: keys read the profile of the
    nvcc a wrapper names, one level down), so that only the release differs.
    """
    from kernelcache import toolchain

    assert NVCC is not None
    named = [t for t in toolchain.script_targets(os.path.realpath(NVCC)) if t.endswith("/nvcc")]
    real = named[0] if named else NVCC
    where.mkdir()
    script = where / "nvcc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        f'  {real} --version | sed "s/V1[0-9.]*/V99.9.99/"\n'
        "else\n"
        f'  exec {real} "$@"\n'
        "fi\n"
    )
    script.chmod(0o755)
    old = time.time() - 3600
    os.utime(script, (old, old))
    return str(script)


def _explained(root: Path, kind: str) -> dict[str, Any]:
    """``kernelcache explain --last-miss KIND --json`` in another process."""
    report: dict[str, Any] = kc_json(
        "explain", "--last-miss", kind, env={"KERNELCACHE_DIR": str(root / "cache")}
    )
    return report


@pytest.mark.parametrize(
    ("change", "label"),
    [
        pytest.param("header", "input[common.cuh]", id="header-edit"),
        pytest.param("flag", "command.args", id="flag"),
        pytest.param("version", "command.nvcc", id="toolchain-version"),
        pytest.param("env", "command.env.CPATH", id="env-nvcc-reads"),
        pytest.param("folder", "command.cwd", id="source-folder-with-g"),
    ],
)
def test_launcher_last_miss_names_the_one_field_that_changed(
    launcher: Path, change: str, label: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernelcache.nvcc.launcher import main

    root = _project(launcher / change)
    monkeypatch.chdir(root)
    argv = ["nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin"]
    if change == "header":
        (root / "common.cuh").write_text(COMMON.replace("2.0f", "3.0f"))
        time.sleep(0.05)
    elif change == "flag":
        argv.insert(2, "-O2")
    elif change == "version":
        argv[0] = _fake_nvcc(launcher / "fake-bin")
    elif change == "env":
        (root / "empty").mkdir()
        monkeypatch.setenv("CPATH", str(root / "empty"))
    else:  # the same compile with -g in two folders: debug info names the folder
        argv.insert(2, "-g")
        other = _project(launcher / "folder-first")
        monkeypatch.chdir(other)
        assert main(argv) == 0
        monkeypatch.chdir(root)
    assert main(argv) == 0
    report = _explained(launcher, "nvcc")
    near = report["nearest"][0]
    assert [d["label"] for d in near["differences"]] == [label], near
    said = near["differences"][0]["words"]
    expected = {
        "header": "header `common.cuh` changed",
        "flag": "flags: added --optimize 2",
        "version": "V99.9.99",
        "env": f"environment variable CPATH: unset → {root / 'empty'}",
        "folder": "the source's folder (debug info on)",
    }[change]
    assert expected in said


def test_explain_a_launcher_command_without_compiling(
    launcher: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"KERNELCACHE_DIR": str(launcher / "cache")}
    base = launcher / "base"

    def explain(*argv: str) -> dict[str, Any]:
        out = kc("explain", "--json", "--", *argv, env={**env, "PWD": str(base)})
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    monkeypatch.chdir(base)
    assert explain("nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin")["status"] == "hit"
    miss = explain("nvcc", "-arch=sm_90", "-cubin", "-O1", "k.cu", "-o", "k.cubin")
    assert miss["status"] == "miss"
    assert [d["label"] for d in miss["nearest"][0]["differences"]] == ["command.args"]
    assert explain("nvcc", "-E", "k.cu") == {
        "status": "uncacheable",
        "reason": "preprocessing (-E)",
    }
    assert not (base / "k.ii").exists()
    gone = explain("nvcc", "-arch=sm_90", "-cubin", "missing.cu", "-o", "m.cubin")
    assert gone["status"] == "uncacheable"
    assert "cannot read input" in gone["reason"]
    # The same command and source, a header edited since: which file, from the manifest.
    (base / "common.cuh").write_text(COMMON.replace("2.0f", "4.0f"))
    try:
        edited = explain("nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin")
        assert [d["label"] for d in edited["inputs"]] == ["input[common.cuh]"]
        text = kc(
            "explain", "--", "nvcc", "-arch=sm_90", "-cubin", "k.cu", "-o", "k.cubin", env=env
        )
        assert "header `common.cuh` changed" in text.stdout
    finally:
        (base / "common.cuh").write_text(COMMON)


# NVRTC -------------------------------------------------------------------------

NVRTC_SOURCE = '#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[0] *= SCALE; }\n'


@pytest.mark.parametrize(
    ("change", "label", "said"),
    [
        pytest.param(
            "header", "included[source_dir/common.cuh]", "header `common.cuh`", id="header"
        ),
        pytest.param("flag", "options", "flags: added --device-debug", id="flag"),
    ],
)
def test_nvrtc_last_miss_names_the_one_field_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, label: str, said: str
) -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    from kernelcache import nvrtc

    monkeypatch.chdir(tmp_path)
    (tmp_path / "common.cuh").write_text("#define SCALE 2.0f\n")
    cache_dir = tmp_path / "cache"
    options = ["-DX=1"]
    with Cache([DiskStore(cache_dir)]) as cache:
        nvrtc.compile(NVRTC_SOURCE, name="k.cu", options=options, cache=cache)
        if change == "header":
            (tmp_path / "common.cuh").write_text("#define SCALE 3.0f\n")
        else:
            options = [*options, "-G"]
        nvrtc.compile(NVRTC_SOURCE, name="k.cu", options=options, cache=cache)
    report = _explained(tmp_path, "nvrtc")
    near = report["nearest"][0]
    labels = [d["label"] for d in near["differences"]]
    if change == "flag":  # -G is debug info: NVRTC keys the folder with it (nvrtc/key.py)
        assert labels == ["options", "paths"]
    else:
        assert labels[0].startswith("included[")
        assert labels[0].endswith("common.cuh]")
        assert len(labels) == 1
    assert said in near["differences"][0]["words"]
