"""What keeps a ``kernelcache nvcc`` hit cheap: a client that imports almost nothing.

A hit is bounded by interpreter start-up (DESIGN.md, performance): the
``kernelcache`` executable starts Python without site and runs the client
(:mod:`kernelcache.nvcc.client`), which asks the warm server. These tests pin
what the client imports on a hit, and that it finds the same cache directory
as ``Settings`` without importing them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernelcache.nvcc import client

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"KERNELCACHE_DIR": "/var/tmp/kc"}, id="absolute"),
        pytest.param({"KERNELCACHE_DIR": "rel/kc"}, id="relative"),
        pytest.param({"KERNELCACHE_DIR": "~/kc"}, id="home"),
        pytest.param({"XDG_CACHE_HOME": "/var/tmp/xdg/"}, id="xdg"),
        pytest.param({"XDG_CACHE_HOME": ""}, id="xdg-empty"),
        pytest.param({"XDG_CACHE_HOME": "rel/xdg"}, id="xdg-relative"),
        pytest.param({"HOME": "/home/someone/"}, id="home-slash"),
        pytest.param({"HOME": "relative"}, id="home-relative"),
        pytest.param({}, id="default"),
    ],
)
def test_client_finds_the_settings_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]
) -> None:
    from kernelcache.errors import ConfigError
    from kernelcache.nvcc import client
    from kernelcache.settings import Settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    for name in ("KERNELCACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = client.cache_dir(dict(os.environb), os.getcwdb())
    if env.get("KERNELCACHE_DIR") == "rel/kc":  # refused by the settings (issue 20)
        assert found is None
        with pytest.raises(ConfigError, match="KERNELCACHE_DIR must be an absolute path"):
            Settings.load()
        return
    if found is None:  # unsure: the launcher then runs in-process, with the Settings
        assert env.get("XDG_CACHE_HOME", "/").startswith("rel") or env.get("HOME") == "relative"
        return
    assert os.path.normpath(os.fsdecode(found)) == os.path.abspath(Settings.load().dir)


#: Modules a launcher hit must not import: each costs milliseconds per call.
NOT_ON_THE_HIT_PATH = (
    "hashlib",  # OpenSSL set-up, ~3 ms
    "platformdirs",  # ~10 ms, when KERNELCACHE_DIR is not set
    "kernelcache.cache",  # the server's: a hit reaches it through the socket
    "kernelcache.nvcc.launcher",
    "kernelcache.settings",
    "subprocess",
    "tempfile",
    "typing",
    "json",
    "re",
    "os",  # the client uses posix directly: os costs ~1 ms without site
)
#: What the ``kernelcache`` front may import beyond ``python -I -S -c pass``: it runs
#: the client from its cached bytecode, so not even the package's ``__init__``.
CLIENT_IMPORTS = {"_socket"}
_LIST_MODULES = """import posix, sys
out = sys.argv.pop(1)
sys.argv[0] = sys.argv.pop(1)
exit_now = posix._exit
def listing_exit(code):  # the client ends with posix._exit: list the modules first
    with open(out, "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
    exit_now(code)
posix._exit = listing_exit
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_a_launcher_hit_imports_little(tmp_path: Path) -> None:
    """The client, run as the ``kernelcache`` executable runs it, imports almost nothing."""
    from launcher_env import clean_env, make_bin, start_server, stats, stop_server

    project = tmp_path / "p"
    shutil.copytree(EXAMPLES, project)
    front = make_bin(tmp_path / "bin")
    env = clean_env(tmp_path / "cache")
    for name in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START"):
        env.pop(name, None)  # what the launcher imports, not what a measuring tool adds
    argv = ["nvcc", "-arch=sm_90", "-cubin", "saxpy.cu", "-o", "saxpy.cubin"]
    subprocess.run([str(front), *argv], cwd=project, env=env, check=True)  # the miss
    start_server(tmp_path / "cache", env)
    bare = subprocess.run(
        [sys.executable, "-I", "-S", "-c", "import sys; print(*sys.modules)"],
        capture_output=True,
        check=True,
    ).stdout.split()
    if not Path(importlib.util.cache_from_source(client.__file__)).exists():
        py_compile.compile(client.__file__)  # what the first import does
    # The front's own Python, as sh starts it (-I -S), with the list written as it exits.
    listing = tmp_path / "modules.txt"
    script = _LIST_MODULES + f"exec(compile(open({str(front)!r}).read(), {str(front)!r}, 'exec'))"
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", script, str(listing), str(front), *argv],
            cwd=project,
            env=env,
            capture_output=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert stats(tmp_path / "cache")["server_hits"] == 1  # it was a hit, from the server
        modules = set(listing.read_text().split())
        assert modules - {m.decode() for m in bare} <= CLIENT_IMPORTS
        assert not modules & set(NOT_ON_THE_HIT_PATH)
        # Through an importing process (python -m kernelcache, kernelcache-cli) a hit
        # still pays for none of the launcher's or the cache's modules.
        code = (
            "import sys\n"
            "from kernelcache.__main__ import main\n"
            f"rc = main({argv!r})\n"
            "modules = sorted(sys.modules)\n"
            "print(rc, *modules)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, check=True
        )
        rc, *imported = run.stdout.decode().split()
        assert rc == "0"
        assert stats(tmp_path / "cache")["server_hits"] == 2
        heavy = set(NOT_ON_THE_HIT_PATH) - {"os", "re", "typing"}  # site imports those
        assert not set(imported) & heavy
    finally:
        stop_server(tmp_path / "cache")


@pytest.mark.parametrize(
    ("change", "used"),
    [
        pytest.param(None, True, id="fresh"),
        pytest.param("touch", False, id="source-newer"),
        pytest.param("hash-based", False, id="hash-based-pyc"),
    ],
)
def test_front_runs_the_client_bytecode_only_when_it_matches(
    tmp_path: Path, change: str | None, used: bool
) -> None:
    front = runpy.run_path(str(EXAMPLES.parent / "bin" / "kernelcache"), run_name="front")
    folder = tmp_path / "kernelcache" / "nvcc"
    folder.mkdir(parents=True)
    source = folder / "client.py"
    source.write_text("def script_main():\n    return 'from the bytecode'\n")
    mode = py_compile.PycInvalidationMode.TIMESTAMP
    if change == "hash-based":
        mode = py_compile.PycInvalidationMode.CHECKED_HASH
    py_compile.compile(str(source), invalidation_mode=mode, doraise=True)
    if change == "touch":
        st = source.stat()
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    module = front["_cached_client"](str(tmp_path))
    if used:
        assert module["script_main"]() == "from the bytecode"
    else:
        assert module is None


_PROBE = """import json, os, sys
print(json.dumps({"path": sys.path, "cwd": os.getcwd(), "argv": sys.argv[1:], "name": __name__}))
"""


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="plain"),
        pytest.param(["-I"], id="isolated"),
        pytest.param(
            ["-P"],
            id="safe-path",
            marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is new in 3.11"),
        ),
    ],
)
def test_run_module_runs_as_dash_m_without_the_current_directory(
    tmp_path: Path, extra: list[str]
) -> None:
    """client.RUN_MODULE: the module runs as ``__main__`` with its arguments; the current
    directory is never on ``sys.path``, and an interpreter that left it out loses nothing."""
    mods, cwd = tmp_path / "mods", tmp_path / "build"
    mods.mkdir()
    cwd.mkdir()
    (mods / "probe_mod.py").write_text(_PROBE)
    env = {**os.environ, "PYTHONPATH": str(mods)}
    code = client.RUN_MODULE % "probe_mod"
    if extra == ["-I"]:  # isolated mode ignores PYTHONPATH: the module comes in by the path
        code = f"import sys; sys.path.insert(1, {str(mods)!r})\n" + code
    proc = subprocess.run(
        [sys.executable, *extra, "-c", code, "a", "b"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(proc.stdout)
    assert (seen["name"], seen["argv"]) == ("__main__", ["a", "b"])
    assert "" not in seen["path"]
    assert str(cwd) not in seen["path"]
    assert str(mods) in seen["path"]  # the module was found: no real entry was dropped
