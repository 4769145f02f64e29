"""What keeps a ``kernelcache nvcc`` hit cheap: no heavy imports, same keys and directories.

The hit path is bounded by interpreter start-up (DESIGN.md, performance), so
these tests pin what it must not import, and check that the cheaper stand-ins
(the built-in SHA-256, the default directory computed without platformdirs)
give exactly what the originals give.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

from kernelcache import keys
from kernelcache.settings import default_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "size",
    [0, 1, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20],
    ids=lambda n: f"{n}B",
)
def test_file_sha256_is_hashlib_sha256(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f"
    data = os.urandom(size)
    path.write_bytes(data)
    assert keys.file_sha256(str(path)) == hashlib.sha256(data).hexdigest()


def test_file_sha256_past_the_builtin_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the built-in's budget is spent, small files go to hashlib: same digests."""
    monkeypatch.setattr(keys, "_builtin_file_bytes", keys.BUILTIN_FILE_BUDGET - 10)
    for size in (5, 100):
        path = tmp_path / f"f{size}"
        path.write_bytes(b"x" * size)
        assert keys.file_sha256(str(path)) == hashlib.sha256(b"x" * size).hexdigest()
    assert keys._builtin_file_bytes == keys.BUILTIN_FILE_BUDGET - 5


def test_key_sha256_is_hashlib_sha256() -> None:
    for data in (b"", b"abc", os.urandom(100_000)):
        assert keys.sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
    # A key computed before the built-in hash was used (main at e5b742e).
    assert keys.make_key("x", a=1) == (
        "c731fbad2960ef372f04ea1e59bec1bb8462cebadfe9935abd285efa8846b31c"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the shortcut is Linux-only")
@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"XDG_CACHE_HOME": "/var/tmp/xdg"}, id="xdg-absolute"),
        pytest.param({"XDG_CACHE_HOME": "/var/tmp/xdg/"}, id="xdg-trailing-slash"),
        pytest.param({"XDG_CACHE_HOME": None}, id="xdg-unset"),
        pytest.param({"XDG_CACHE_HOME": ""}, id="xdg-empty"),
        pytest.param({"XDG_CACHE_HOME": "rel/xdg"}, id="xdg-relative"),
        pytest.param({"XDG_CACHE_HOME": None, "HOME": "/home/someone/"}, id="home-slash"),
        pytest.param({"XDG_CACHE_HOME": None, "HOME": "relative"}, id="home-relative"),
    ],
)
def test_default_dir_is_platformdirs(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert default_dir() == platformdirs.user_cache_dir("kernelcache", appauthor=False)


#: Modules a launcher hit must not import: each costs milliseconds per call.
NOT_ON_THE_HIT_PATH = (
    "hashlib",  # OpenSSL set-up, ~3 ms
    "platformdirs",  # ~10 ms, when KERNELCACHE_DIR is not set
    "kernelcache.cache",  # with single-flight: only a miss needs them
    "kernelcache.singleflight",
    "subprocess",
    "tempfile",
    "typing",  # ~3 ms: type-only imports sit under TYPE_CHECKING
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_a_launcher_hit_imports_little(tmp_path: Path) -> None:
    project = tmp_path / "p"
    shutil.copytree(EXAMPLES, project)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for name in ("KERNELCACHE_DIR", "KERNELCACHE_REMOTE", "KERNELCACHE_DISABLE"):
        env.pop(name, None)
    argv = ["nvcc", "-arch=sm_90", "-cubin", "saxpy.cu", "-o", "saxpy.cubin"]
    code = (  # json is imported after the listing: the check must not see its own imports
        "import sys\n"
        "from kernelcache.__main__ import main\n"
        f"rc = main({argv!r})\n"
        "modules = sorted(sys.modules)\n"
        "import json\n"
        "print(json.dumps([rc, modules]))\n"
    )
    runs = []
    for _ in range(2):  # a miss, then a hit
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, check=True
        )
        rc, modules = json.loads(proc.stdout.decode().splitlines()[-1])
        runs.append((rc, set(modules), (project / "saxpy.cubin").read_bytes()))
    (miss_rc, miss_modules, cold), (hit_rc, hit_modules, warm) = runs
    assert miss_rc == hit_rc == 0 and cold == warm
    assert "kernelcache.cache" in miss_modules  # the miss did go through the Cache
    assert not hit_modules & set(NOT_ON_THE_HIT_PATH)
    stats = json.loads((tmp_path / "xdg" / "kernelcache" / "nvcc-stats.json").read_bytes())
    assert stats["hits"] == 1 and stats["misses"] == 1
