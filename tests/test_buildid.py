"""``kernelcache.buildid``: the GNU build ID read from real shared libraries built here with g++."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kernelcache import buildid

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to link libraries")


def _library(folder: Path, name: str, body: str, build_id: str | None = "sha1") -> Path:
    source = folder / f"{name}.cpp"
    source.write_text(f'extern "C" int value() {{ return {body}; }}\n')
    out = folder / name
    flag = ["-Wl,--build-id=none"] if build_id is None else [f"-Wl,--build-id={build_id}"]
    subprocess.run(["g++", "-shared", "-fPIC", *flag, "-o", str(out), str(source)], check=True)
    return out


def test_the_id_the_linker_was_given_is_read(tmp_path: Path) -> None:
    given = "0123456789abcdef0123456789abcdef01234567"
    lib = _library(tmp_path, "libgiven.so", "1", build_id="0x" + given)
    assert buildid.build_id(str(lib)) == given
    assert buildid.identity(str(lib)) == f"build-id:{given} size:{lib.stat().st_size}"


def test_a_rebuild_of_other_code_gets_another_id_and_the_same_code_the_same(tmp_path: Path) -> None:
    one = buildid.build_id(str(_library(tmp_path, "libk.so", "1")))
    other = buildid.build_id(str(_library(tmp_path, "libk.so", "2")))
    again = buildid.build_id(str(_library(tmp_path, "libk.so", "1")))
    assert one is not None
    assert len(one) == 40  # SHA-1, ld's default kind
    assert other != one
    # A bit-identical rebuild: the linker digests the content, so the same ID.
    assert again == one


def test_no_build_id_means_none(tmp_path: Path) -> None:
    assert buildid.identity(str(_library(tmp_path, "libnone.so", "1", build_id=None))) is None


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"#!/bin/sh\nexec true\n", id="script"),
        pytest.param(b"\x7fELF\x02\x01\x01" + b"\0" * 20, id="truncated-header"),
    ],
)
def test_what_is_not_a_whole_elf_file_has_none(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "file"
    path.write_bytes(content)
    assert buildid.build_id(str(path)) is None


def test_a_damaged_note_table_has_none_and_is_read_within_bounds(tmp_path: Path) -> None:
    lib = _library(tmp_path, "libdamaged.so", "1")
    data = bytearray(lib.read_bytes())
    # e_phnum (64-bit header, offset 56) far past the table: rejected, nothing huge read.
    data[56:58] = (0xFFFF).to_bytes(2, "little")
    lib.write_bytes(bytes(data))
    assert buildid.build_id(str(lib)) is None


def test_a_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent"):
        buildid.build_id(str(tmp_path / "absent.so"))
