"""The kernelcache command, run as a real subprocess on a real cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kernelcache import Cache, DiskStore, Entry, MemoryStore, Settings
from kernelcache.cli.main import _split_delegated
from kernelcache.cli.output import format_age, table

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(autouse=True)
def _entry_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests damage and age entry files: small entries go into files here, as before
    packing. The CLI over packed entries: tests/test_disk_pack.py."""
    monkeypatch.setattr(DiskStore, "pack_max", 0)


def kc(cache_dir: Path | None, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``python -m kernelcache [--dir cache_dir] ARGS``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCACHE_")}
    full_env.update(PYTHONPATH=SRC, **(env or {}))
    prefix = ["--dir", str(cache_dir)] if cache_dir is not None else []
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", *prefix, *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def kc_json(cache_dir: Path, *args: str) -> Any:
    proc = kc(cache_dir, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def entry_files(cache_dir: Path) -> dict[str, bytes]:
    """Every entry's stored bytes by key, whether a file or packed (a CLI process packs
    small entries: stores/disk/pack.py)."""
    if not (cache_dir / "v1").exists():
        return {}
    store = DiskStore(cache_dir, read_only=True)
    stored = {}
    for info in store.scan():
        key = info.key
        got = store.get(key)
        assert got is not None
        stored[key] = b"".join(got.pack_parts(key))
    store.close()
    return stored


KEYS = [f"{i:02d}" + "ab" * 31 for i in range(5)]


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    with Cache([MemoryStore(), DiskStore(path)], settings=Settings.load(dir=str(path))) as cache:
        for i, key in enumerate(KEYS):
            cache.get_or_compile(
                key,
                lambda i=i: Entry(  # type: ignore[misc]
                    {"kernel.cubin": bytes([i]) * (1000 * (i + 1)), "kernel.ptx": b"ptx"},
                    meta={"name": f"kernel{i}"},
                ),
            )
        for _ in range(3):
            cache.get(KEYS[1])
    # Distinct last-use times: KEYS[0] least recently used.
    for i, key in enumerate(KEYS):
        info = DiskStore(path, read_only=True).info(key)
        assert info is not None
        os.utime(info.extra["path"], (1_000_000 + i * 1000,) * 2)
    return path


def test_ls_json_and_sorting(cache_dir: Path) -> None:
    rows = kc_json(cache_dir, "ls")
    assert [r["key"] for r in rows] == KEYS  # by age: least recently used first
    by_size = kc_json(cache_dir, "ls", "--sort", "size")
    assert [r["key"] for r in by_size] == KEYS[::-1]
    assert by_size[0]["size"] == os.path.getsize(
        DiskStore(cache_dir, read_only=True).info(KEYS[4]).extra["path"]  # type: ignore[union-attr]
    )
    by_hits = kc_json(cache_dir, "ls", "--sort", "hits")
    assert by_hits[0]["key"] == KEYS[1]
    assert by_hits[0]["hits"] == 3
    human = kc(cache_dir, "ls")
    assert human.returncode == 0
    assert human.stdout.splitlines()[0].split()[:3] == ["KEY", "KIND", "SIZE"]
    assert len(human.stdout.splitlines()) == 6
    assert {r["kind"] for r in rows} == {None}  # keys made by hand: no record, no kind


def test_ls_names_the_integration_of_each_entry_from_its_key_record(tmp_path: Path) -> None:
    from kernelcache.keys import KeyBuilder

    path = tmp_path / "cache"
    keys = {
        KeyBuilder("jax/1").add("key", "jit_f-1").hexdigest(): "jax",
        KeyBuilder("kernelcache.nvcc.result").add("source", "k").hexdigest(): "nvcc",
    }
    with Cache([DiskStore(path)], settings=Settings.load(dir=str(path))) as cache:
        for key in keys:
            cache.put(key, Entry({"a": b"x"}, meta={"compile_seconds": 1.0}))
    rows = kc_json(path, "ls")
    assert {r["key"]: r["kind"] for r in rows} == keys
    human = kc(path, "ls").stdout
    assert " jax " in human
    assert " nvcc " in human


def test_show_json_has_meta_sizes_and_checksums(cache_dir: Path) -> None:
    report = kc_json(cache_dir, "show", KEYS[2])
    assert report["meta"]["name"] == "kernel2"
    assert "compile_seconds" in report["meta"]
    artifacts = {a["name"]: a for a in report["artifacts"]}
    cubin = bytes([2]) * 3000
    assert artifacts["kernel.cubin"]["size"] == 3000
    assert artifacts["kernel.cubin"]["xxh3_128"] == xxhash.xxh3_128_hexdigest(cubin)
    human = kc(cache_dir, "show", KEYS[2])
    assert human.returncode == 0
    assert "kernel.cubin" in human.stdout
    assert "kernel2" in human.stdout
    missing = kc(cache_dir, "show", "ff" * 32)
    assert missing.returncode == 1
    assert "not in the cache" in missing.stderr
    bad = kc(cache_dir, "show", "../etc")
    assert bad.returncode == 2
    assert "invalid cache key" in bad.stderr


def test_stats_json_and_human(cache_dir: Path) -> None:
    report = kc_json(cache_dir, "stats")
    memory = report["lifetime"]["tiers"]["memory"]
    assert memory["hits"] == 3
    assert memory["misses"] == 5
    assert report["lifetime"]["compile"]["compiles"] == 5
    assert report["entries"] == 5
    assert report["bytes"] > 15000
    human = kc(cache_dir, "stats")
    assert human.returncode == 0
    assert "HIT" not in human.stderr
    assert "memory" in human.stdout
    assert "compiles 5" in human.stdout
    zeroed = kc_json(cache_dir, "stats", "--zero")
    assert zeroed["period"]["tiers"] == {}
    assert zeroed["lifetime"]["tiers"]["memory"]["hits"] == 3


def test_stats_of_a_directory_without_a_cache(tmp_path: Path) -> None:
    out = kc(tmp_path / "none", "stats", "--json")
    assert out.returncode == 1  # a typo in --dir is said, not shown as zeros (issue 20)
    assert "no cache at" in out.stderr
    assert not (tmp_path / "none").exists()  # looking creates nothing


def test_verify_reports_and_fixes_damage(cache_dir: Path) -> None:
    assert kc(cache_dir, "verify").returncode == 0
    info = DiskStore(cache_dir, read_only=True).info(KEYS[3])
    assert info is not None
    path = Path(info.extra["path"])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = kc(cache_dir, "verify", "--json")
    assert proc.returncode == 1  # damage found and left in place
    report = json.loads(proc.stdout)
    assert report["checked"] == 5
    assert [b["key"] for b in report["bad"]] == [KEYS[3]]
    assert "checksum" in report["bad"][0]["error"]
    assert path.exists()  # without --fix nothing is removed
    fixed = kc(cache_dir, "verify", "--fix")
    assert fixed.returncode == 0
    assert "removed" in fixed.stdout
    assert not path.exists()
    assert len(entry_files(cache_dir)) == 4


def test_prune_by_entries_size_and_age(cache_dir: Path) -> None:
    assert kc(cache_dir, "prune", "--max-entries", "4").returncode == 0
    assert [r["key"] for r in kc_json(cache_dir, "ls")] == KEYS[1:]  # the LRU one went
    sizes = {r["key"]: r["size"] for r in kc_json(cache_dir, "ls")}
    limit = sizes[KEYS[3]] + sizes[KEYS[4]]
    assert kc(cache_dir, "prune", "--max-size", str(limit)).returncode == 0
    assert [r["key"] for r in kc_json(cache_dir, "ls")] == KEYS[3:]
    info = DiskStore(cache_dir, read_only=True).info(KEYS[4])
    assert info is not None
    os.utime(info.extra["path"])  # used just now
    assert kc(cache_dir, "prune", "--older-than", "30d").returncode == 0
    assert [r["key"] for r in kc_json(cache_dir, "ls")] == [KEYS[4]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["prune", "--max-size", "5X"], "invalid size", id="bad-size"),
        pytest.param(["prune", "--older-than", "soon"], "invalid age", id="bad-age"),
        pytest.param(["prune", "--max-entries", "-1"], "invalid count", id="bad-count"),
        pytest.param(["prune"], "needs at least one", id="no-limit"),
        pytest.param(["ls", "--sort", "name"], "invalid choice", id="bad-sort"),
        pytest.param(["frobnicate"], "invalid choice", id="bad-command"),
        pytest.param([], "required", id="no-command"),
        pytest.param(["clear"], "without --yes", id="clear-unconfirmed"),
    ],
)
def test_bad_arguments_exit_2(cache_dir: Path, args: list[str], message: str) -> None:
    proc = kc(cache_dir, *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert len(entry_files(cache_dir)) == 5


def test_bad_environment_setting_exits_2(cache_dir: Path) -> None:
    proc = kc(cache_dir, "stats", env={"KERNELCACHE_MAX_SIZE": "lots"})
    assert proc.returncode == 2
    assert "invalid size" in proc.stderr


def test_export_clear_import_restores_every_entry_byte_for_byte(
    cache_dir: Path, tmp_path: Path
) -> None:
    before = entry_files(cache_dir)
    bundle = tmp_path / "warm.kcb"
    exported = kc(cache_dir, "export", str(bundle))
    assert exported.returncode == 0
    assert "exported 5 entries" in exported.stdout
    cleared = kc(cache_dir, "clear", "--yes")
    assert cleared.returncode == 0
    assert entry_files(cache_dir) == {}
    imported = kc(cache_dir, "import", str(bundle))
    assert imported.returncode == 0
    assert "imported 5 entries" in imported.stdout
    assert entry_files(cache_dir) == before
    again = kc(cache_dir, "import", str(bundle))
    assert "imported 0 entries" in again.stdout
    assert "5 were already present" in again.stdout
    # Into a fresh directory, too.
    fresh = tmp_path / "fresh"
    assert kc(fresh, "import", str(bundle)).returncode == 0
    assert entry_files(fresh) == before


def test_export_since_takes_recently_used_entries(cache_dir: Path, tmp_path: Path) -> None:
    info = DiskStore(cache_dir, read_only=True).info(KEYS[0])
    assert info is not None
    os.utime(info.extra["path"], (time.time(), time.time()))
    bundle = tmp_path / "recent.kcb"
    assert kc(cache_dir, "export", str(bundle), "--since", "1h").returncode == 0
    fresh = tmp_path / "fresh"
    assert kc(fresh, "import", str(bundle)).returncode == 0
    assert [r["key"] for r in kc_json(fresh, "ls")] == [KEYS[0]]


def test_damaged_bundle_imports_nothing(cache_dir: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "warm.kcb"
    assert kc(cache_dir, "export", str(bundle)).returncode == 0
    data = bundle.read_bytes()
    fresh = tmp_path / "fresh"
    for damaged in (data[: len(data) - 30], data[: len(data) // 2]):
        bundle.write_bytes(damaged)
        proc = kc(fresh, "import", str(bundle))
        assert proc.returncode == 1
        assert "truncated" in proc.stderr
        assert "nothing imported" in proc.stderr
        assert not fresh.exists() or entry_files(fresh) == {}
    flipped = bytearray(data)
    flipped[len(data) - 40] ^= 1  # inside the last entry's data: found only at the end
    bundle.write_bytes(bytes(flipped))
    proc = kc(fresh, "import", str(bundle))
    assert proc.returncode == 1
    assert "record 4 is not a valid entry" in proc.stderr
    assert not fresh.exists() or entry_files(fresh) == {}


def test_config_shows_sources(tmp_path: Path) -> None:
    rows = kc_json(tmp_path / "c", "config")
    by_name = {r["name"]: r for r in rows}
    assert by_name["dir"]["value"] == str(tmp_path / "c")
    assert by_name["dir"]["source"] == "argument"
    assert by_name["max_bytes"]["source"] == "default"
    assert by_name["max_bytes"]["variable"] == "KERNELCACHE_MAX_SIZE"
    env = kc(None, "config", env={"KERNELCACHE_DIR": str(tmp_path), "KERNELCACHE_SECRET": "s3"})
    assert "environment KERNELCACHE_DIR" in env.stdout
    assert "s3" not in env.stdout


def test_dir_option_after_the_command_and_help(tmp_path: Path) -> None:
    proc = kc(None, "config", "--json", "--dir", str(tmp_path / "x"))
    assert json.loads(proc.stdout)[0]["value"] == str(tmp_path / "x")
    helped = kc(None, "--help")
    assert helped.returncode == 0
    assert "export" in helped.stdout
    assert "nvcc" in helped.stdout


def test_delegated_commands_keep_their_arguments() -> None:
    assert _split_delegated(["nvcc", "-cubin", "--dir", "x"]) == (
        "nvcc",
        ["-cubin", "--dir", "x"],
        None,
    )
    assert _split_delegated(["--dir=/c", "demo", "--fast"]) == ("demo", ["--fast"], "/c")
    assert _split_delegated(["--dir", "/c", "ls"]) == (None, ["--dir", "/c", "ls"], None)


def test_output_helpers() -> None:
    assert table(["A", "NUM"], [["x", 5], ["long", 10]], right=[1]).splitlines() == [
        "A     NUM",
        "x       5",
        "long   10",
    ]
    assert [format_age(s) for s in (5, 90, 7200, 86400 * 3.5, 86400 * 30)] == [
        "5s",
        "1.5m",
        "2.0h",
        "3.5d",
        "4.3w",
    ]


def on_disk(root: Path) -> int:
    """Bytes of entry files and extracted copies (``files``: where older versions put them)."""
    parts = [root / "v1" / part for part in ("entries", "extracted", "files")]
    return sum(p.lstat().st_size for part in parts for p in part.rglob("*") if p.is_file())


def test_prune_counts_extracted_copies(tmp_path: Path) -> None:
    """prune --max-size 1M left 2 MB: the copies made for Entry.path() were not counted."""
    root = tmp_path / "c"
    with Cache(settings=Settings.load(dir=str(root))) as cache:
        for i in range(16):
            stored = cache.put(f"{i:02d}" + "cd" * 31, Entry({"k.cubin": bytes([i]) * 128_000}))
            stored.path("k.cubin")  # a copy of the same size beside each entry
    assert on_disk(root) > 2 << 20
    proc = kc(root, "prune", "--max-size", "1M")
    assert proc.returncode == 0, proc.stderr
    assert on_disk(root) <= 1 << 20
    left = proc.stdout.rsplit("(", 1)[1].split(")")[0]  # "... N entries (X MiB) remain"
    from kernelcache.units import format_size

    assert left == format_size(on_disk(root))


def test_import_from_standard_input_and_a_named_pipe(cache_dir: Path, tmp_path: Path) -> None:
    """The bundle is read once: a pipe cannot be read twice (verify, then import)."""
    bundle = tmp_path / "warm.kcb"
    assert kc(cache_dir, "export", str(bundle)).returncode == 0
    fresh = tmp_path / "fresh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCACHE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "--dir", str(fresh), "import", "-"],
        env={**env, "PYTHONPATH": SRC},
        input=bundle.read_bytes(),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert b"imported 5 entries" in proc.stdout, proc.stderr
    assert entry_files(fresh) == entry_files(cache_dir)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    other = tmp_path / "other"

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(bundle.read_bytes())

    import threading

    threading.Thread(target=feed, daemon=True).start()
    proc2 = kc(other, "import", str(fifo))
    assert proc2.returncode == 0, proc2.stderr
    assert "imported 5 entries" in proc2.stdout, proc2.stderr
    assert entry_files(other) == entry_files(cache_dir)


def test_import_refuses_a_key_twice_with_different_contents(tmp_path: Path) -> None:
    from kernelcache.bundle import BundleWriter

    bundle = tmp_path / "dup.kcb"
    with open(bundle, "wb") as f:
        writer = BundleWriter(f)
        writer.add(Entry({"a": b"first"}), KEYS[0])
        writer.add(Entry({"a": b"other"}), KEYS[1])
        writer.add(Entry({"a": b"second"}), KEYS[0])
        writer.finish()
    fresh = tmp_path / "fresh"
    proc = kc(fresh, "import", str(bundle))
    assert proc.returncode == 1
    assert "appears twice with different contents" in proc.stderr
    assert "nothing imported" in proc.stderr
    assert not fresh.exists() or entry_files(fresh) == {}
