"""Toolchain probes: stable strings naming the compiler that produced a binary.

Each probe returns a string to put into a key field. The same toolchain gives
the same string in every process and on every machine (versions and content
hashes, never paths or timestamps); a probe that cannot run returns
``probe_failed:<ExceptionName>``, so a broken environment never shares keys
with a working one and keys stay stable across repeated failing calls.

Content hashes of large files (``libnvrtc.so`` is ~140 MB, ``nvcc``) are
memoised in a small JSON file under the cache directory, keyed by path and
``stat`` signature (``_fs.signature``), so a fresh process does not re-hash
the compiler on every call. The memo names the compiler in every key, so it
is read and written only as :mod:`kernelcache._memos` allows (a trusted
directory, never through a link, nothing when read-only).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from typing import TYPE_CHECKING

from kernelcache import _fs, _memos
from kernelcache._dirs import cache_dir

if TYPE_CHECKING:
    from typing import Any

#: Name of the memo file under the cache directory.
MEMO_FILE = "toolchain-probes.json"
_MEMO_VERSION = 2  # 2: signatures hold the device too (kernelcache._fs.signature)
_PROBE_ERRORS = (ImportError, OSError, RuntimeError, ValueError)

_memo: dict[str, Any] | None = None
_memo_path: str | None = None


def failed(exc: BaseException) -> str:
    """The key string of a probe that raised ``exc``."""
    return f"probe_failed:{type(exc).__name__}"


def _signature(st: os.stat_result) -> list[int]:
    return list(_fs.signature(st))  # a list: what the JSON memo gives back


def _trustworthy(st: os.stat_result) -> bool:
    """A file modified this recently is hashed but not memoised (``_fs.too_new``)."""
    # Toolkits on NFS are trusted by stat (see _fs.too_new): re-probing costs a compile.
    return not _fs.too_new(st, time.time_ns(), network=False)


def memo_path() -> str:
    """Where probe results are memoised (``<cache dir>/toolchain-probes.json``)."""
    return os.path.join(cache_dir(), MEMO_FILE)


def _load_memo() -> dict[str, Any]:
    """The memo of this process, read once per cache directory (:mod:`kernelcache._memos`)."""
    global _memo, _memo_path
    path = memo_path()
    if _memo is None or _memo_path != path:
        _memo_path = path
        data = _memos.load(MEMO_FILE)  # refused, missing or damaged: empty, it is only a memo
        tables = (data.get("files"), data.get("executables"))
        if data.get("version") != _MEMO_VERSION or not all(isinstance(t, dict) for t in tables):
            data = {"version": _MEMO_VERSION, "files": {}, "executables": {}}
        _memo = data
    return _memo


def _save_memo(memo: dict[str, Any]) -> None:
    """Write the memo (not when read-only, nor into a refused directory); a failure only costs a re-hash later."""
    _memos.save(MEMO_FILE, memo)


def file_digest(path: str) -> str:
    """SHA-256 of a file's content, memoised on disk by real path and stat signature."""
    real = _fs.realpath(path)
    st = os.stat(real)
    memo = _load_memo()
    known = memo["files"].get(real)
    if known is not None and known.get("sig") == _signature(st):
        return str(known["sha256"])
    from kernelcache.keys import file_sha256  # only when a file must be hashed

    digest = file_sha256(real)
    if _trustworthy(st):
        memo["files"][real] = {"sig": _signature(st), "sha256": digest}
        _save_memo(memo)
    return digest


def script_targets(path: str) -> list[str]:
    """Absolute paths of existing files a wrapper script refers to.

    ``/usr/local/bin/nvcc`` is often ``exec /usr/local/cuda-X/bin/nvcc "$@"``:
    hashing only the script would keep the identity when the toolkit it
    points at is replaced, so the files it names are hashed too.
    """
    with open(path, "rb") as f:
        head = f.read(2)
        if head != b"#!":
            return []  # a binary: two bytes tell, where the whole head cost a 64 KB read
        head += f.read(65534)
    found = []
    for raw in _path_words(head[2:]):
        candidate = os.fsdecode(raw)
        if os.path.isfile(candidate) and candidate not in found:
            found.append(candidate)
    return found[:8]


# Bytes a path word is made of (what a regex's word class, ``.+-`` and ``/`` match in
# bytes); every other byte ends one.
_WORD = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-/"
_BREAKS = bytes(range(256)).translate(None, _WORD)
_BLANK = bytes.maketrans(_BREAKS, b" " * len(_BREAKS))


def _path_words(text: bytes) -> list[bytes]:
    """Each absolute-looking path in ``text``: a run of path bytes from its first ``/`` on.

    What ``re.findall`` of the pattern ``/`` + one or more of :data:`_WORD` returns,
    without the regex: compiling it cost a fresh process's first hit ~0.2 ms,
    whenever nvcc is a wrapper script.
    """
    words = []
    for run in text.translate(_BLANK).split():
        slash = run.find(b"/")
        if slash >= 0 and len(run) > slash + 1:
            words.append(run[slash:])
    return words


def _run_version(path: str) -> str:
    import subprocess  # only when a probe has to run a program

    try:
        proc = subprocess.run(
            [path, "--version"],
            capture_output=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.SubprocessError as exc:
        raise RuntimeError(f"{path} --version did not finish: {exc}") from exc
    output = (proc.stdout + proc.stderr).decode("utf-8", "replace").strip()
    return f"rc={proc.returncode}\n{output}"


def executable(path: str) -> str:
    """Identity of a compiler executable: its ``--version`` output and content hashes.

    Memoised on disk by path and the stat signatures of the file (and of the
    files a wrapper script names), so a hit costs a few ``stat`` calls.
    """
    try:
        real = _fs.realpath(path)
        return _executable(real, script_targets(real))
    except _PROBE_ERRORS as exc:
        return failed(exc)


def _executable(real: str, targets: list[str]) -> str:
    """:func:`executable` of a real path whose wrapper targets are known (raises)."""
    sigs = [_signature(os.stat(p)) for p in [real, *targets]]
    memo = _load_memo()
    known = memo["executables"].get(real)
    if known is not None and known.get("sigs") == sigs:
        return str(known["identity"])
    version = _run_version(real)
    digests = [file_digest(p) for p in [real, *targets]]
    identity = f"{os.path.basename(real)}\n{version}\nsha256:{','.join(digests)}"
    if all(_trustworthy(os.stat(p)) for p in [real, *targets]):
        memo["executables"][real] = {"sigs": sigs, "identity": identity}
        _save_memo(memo)
    return identity


def nvcc(path: str | None = None) -> str:
    """Identity of nvcc (``path``, or the one on ``PATH``) plus its ``nvcc.profile``."""
    resolved = path if path is not None and os.sep in path else shutil.which(path or "nvcc")
    if resolved is None:
        return failed(FileNotFoundError())
    try:
        # Resolved once for both: a key is derived per lookup.
        real = _fs.realpath(resolved)
        targets = script_targets(real)
        identity = _executable(real, targets)
    except _PROBE_ERRORS as exc:
        return failed(exc)
    # nvcc.profile sets include and library paths (and reads the environment).
    for profile in nvcc_profiles(resolved, targets):
        if os.path.isfile(profile):
            identity += f"\nprofile:{file_digest(profile)}"
    return identity


def nvcc_profiles(path: str, targets: list[str]) -> list[str]:
    """The ``nvcc.profile`` files nvcc run as ``path`` may read.

    nvcc reads the profile in the directory of the path it was run by, *not*
    through symlinks (checked with 13.0: a symlink ``bin/nvcc`` reads
    ``bin/nvcc.profile``; issue 19); a wrapper script's ``exec``'d nvcc reads
    its own. The real binary's directory is listed too: keying a file nvcc
    does not read costs nothing, leaving out one it does costs a stale binary.
    """
    binaries = [path] + [t for t in targets if os.path.basename(t) == "nvcc"]
    out: list[str] = []
    for binary in binaries:
        for where in (os.path.abspath(binary), _fs.realpath(binary)):
            profile = os.path.join(os.path.dirname(where), "nvcc.profile")
            if profile not in out:
                out.append(profile)
    return out


def _loaded_library(fragment: str) -> str | None:
    """Path of a shared library loaded in this process whose name contains ``fragment``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if fragment in os.path.basename(path) and path.startswith("/"):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def nvrtc() -> str:
    """NVRTC's version from the library itself, plus the content hash of the library."""
    try:
        from cuda.bindings import nvrtc as _nvrtc

        err, major, minor = _nvrtc.nvrtcVersion()
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"nvrtcVersion failed: {err}")
        identity = f"nvrtc {major}.{minor}"
        # major.minor is shared by patch releases that can change codegen.
        library = _loaded_library("libnvrtc.so")
        if library is not None:
            identity += f" sha256:{file_digest(library)}"
        return identity
    except _PROBE_ERRORS as exc:
        return failed(exc)


def _cuda_call(result: tuple[Any, ...]) -> Any:
    from cuda.bindings import driver as _driver

    err, *values = result
    if err != _driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def driver() -> str:
    """The CUDA driver's version (``cuDriverGetVersion``)."""
    try:
        from cuda.bindings import driver as _driver

        return f"cuda-driver {_cuda_call(_driver.cuDriverGetVersion())}"
    except _PROBE_ERRORS as exc:
        return failed(exc)


@functools.cache
def gpu_arch(device: int = 0) -> str:
    """The compute capability of GPU ``device`` as ``sm_XY``."""
    try:
        from cuda.bindings import driver as _driver

        _cuda_call(_driver.cuInit(0))
        dev = _cuda_call(_driver.cuDeviceGet(device))
        attr = _driver.CUdevice_attribute
        major = _cuda_call(
            _driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        )
        minor = _cuda_call(
            _driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        )
        return f"sm_{major}{minor}"
    except _PROBE_ERRORS as exc:
        return failed(exc)


@functools.cache
def triton() -> str:
    """Triton's installed version (from package metadata: importing triton takes a second)."""
    try:
        from importlib.metadata import version

        return f"triton {version('triton')}"
    except _PROBE_ERRORS as exc:
        return failed(exc)
