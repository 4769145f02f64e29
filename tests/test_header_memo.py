"""Warm NVRTC and cuda.core hits trust a header's stat signature only while it holds (issue 16).

A process remembers the key it derived from the headers' contents and reuses
it while every header it read keeps its stat signature (device, inode, size,
mtime, ctime), and never when a header is younger than the timestamp
granularity. Each case runs through both integrations with real NVRTC
compiles: ``kernelcache.nvrtc.compile``, and cuda.core's
``make_program_cache_key`` with ``kernelcache.cuda_core.header_digest`` as its
``extra_digest`` in front of a ``ProgramCache``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from kernelcache import _fs, nvrtc
from kernelcache.cache import Cache
from kernelcache.nvrtc import includes
from kernelcache.nvrtc import key as nvrtc_key
from kernelcache.stores.memory import MemoryStore

SOURCE = (
    '#include "scale.cuh"\nextern "C" __global__ void k(float* x) { x[threadIdx.x] *= SCALE; }\n'
)
HEADER = "#pragma once\n#define SCALE 2.0f\n"

#: A compile through one integration: (binary, hit).
Compile = Callable[[], tuple[bytes, bool]]


def _nvrtc(cache: Cache) -> Compile:
    def run() -> tuple[bytes, bool]:
        result = nvrtc.compile(SOURCE, name="k.cu", include_dirs=["inc"], cache=cache)
        return result.binary, result.hit

    return run


def _cuda_core(cache: Cache) -> Compile:
    cuda_core = pytest.importorskip("kernelcache.cuda_core")
    from cuda.core import Program, ProgramOptions
    from cuda.core.utils import make_program_cache_key

    options = ProgramOptions(arch="sm_90", include_path=["inc"])
    resource = cuda_core.ProgramCache(cache)

    def run() -> tuple[bytes, bool]:
        key = make_program_cache_key(
            code=SOURCE,
            code_type="c++",
            options=options,
            target_type="cubin",
            extra_digest=cuda_core.header_digest(SOURCE, options),
        )
        data = resource.get(key)
        if data is not None:
            return bytes(data), True
        code = Program(SOURCE, "c++", options).compile("cubin")
        resource[key] = code
        return bytes(code.code), False

    return run


@pytest.fixture(params=["nvrtc", "cuda_core"])
def compile_(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Compile]:
    """A project (``inc/scale.cuh``) in the working directory and a fresh memo."""
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "scale.cuh").write_text(HEADER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(nvrtc_key, "memo", nvrtc_key.KeyMemo())
    if request.param == "cuda_core":
        cuda_core = pytest.importorskip("kernelcache.cuda_core")
        monkeypatch.setattr(cuda_core, "digests", nvrtc_key.KeyMemo())
    with Cache([MemoryStore()], persist_stats=False) as cache:
        yield _nvrtc(cache) if request.param == "nvrtc" else _cuda_core(cache)


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One item per scan of the include graph (a key derived from the files' contents)."""
    seen: list[int] = []
    real = includes.scan

    def counting(*args: object, **kwargs: object) -> includes.Scan:
        seen.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(includes, "scan", counting)
    return seen


@pytest.fixture
def trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a header's stat vouch for it at once (files a test writes are seconds old at most;
    os.utime cannot age them: it sets ctime to now)."""
    monkeypatch.setattr(_fs, "TOO_NEW_NS", -1)


def header() -> Path:
    return Path("inc") / "scale.cuh"


def warm_up(compile_: Compile) -> bytes:
    binary, hit = compile_()
    assert not hit
    assert compile_() == (binary, True)  # now remembered: the header's stat vouches for it
    return binary


@pytest.mark.usefixtures("trusted")
def test_an_edit_of_the_same_size_and_mtime_misses_every_time(compile_: Compile) -> None:
    """Edits within the same second (here: the very same mtime) that keep the size: only
    the ctime tells, and each one is a miss with the edited header's binary."""
    binaries = {warm_up(compile_)}
    for scale in ("3.0f", "4.0f", "5.0f"):
        before = os.stat(header())
        header().write_text(HEADER.replace("2.0f", scale))
        os.utime(header(), ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(header())
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
            before.st_size,
            before.st_mtime_ns,
            before.st_ino,
        )
        binary, hit = compile_()
        assert not hit
        assert binary not in binaries
        binaries.add(binary)
        assert compile_() == (binary, True)


@pytest.mark.usefixtures("trusted")
def test_a_header_renamed_over_misses(compile_: Compile, tmp_path: Path) -> None:
    """A new file of the same size and mtime renamed over the header: another inode."""
    first = warm_up(compile_)
    before = os.stat(header())
    staged = tmp_path / "inc" / "scale.cuh.new"
    staged.write_text(HEADER.replace("2.0f", "7.0f"))
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(staged, header())
    binary, hit = compile_()
    assert not hit
    assert binary != first


@pytest.mark.usefixtures("trusted")
def test_a_touch_without_change_rescans_once_and_hits(compile_: Compile, scans: list[int]) -> None:
    """The stat check notices the touch (one scan of the contents), the contents decide (a hit)."""
    first = warm_up(compile_)
    assert len(scans) == 1  # the cold compile's; the warm one read nothing
    os.utime(header())
    assert compile_() == (first, True)
    assert len(scans) == 2
    assert compile_() == (first, True)
    assert len(scans) == 2  # remembered again under the new signature


def test_a_header_younger_than_the_granularity_is_never_trusted(
    compile_: Compile, scans: list[int]
) -> None:
    """A header written moments ago (an edit in the same clock tick could keep its stat):
    its contents are scanned on every call, however many."""
    first, hit = compile_()
    assert not hit
    for calls in range(2, 5):
        assert compile_() == (first, True)
        assert len(scans) == calls
