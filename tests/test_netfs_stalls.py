"""Issue 40: on a slow shared filesystem no caller waits long behind another process, and
what a process leaves in staging goes at the next open or put on that node.

Every holder is a real process (a lease file or an ``flock`` held by a child);
a wait that is not bounded shows as a call still running when the test looks.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelcache import Cache, Entry
from kernelcache.settings import Settings
from kernelcache.stats.totals import read_totals
from kernelcache.stores import DiskStore
from kernelcache.stores.disk import cleaner, store, tierlock
from netfs import NetFS

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: Longer than any bounded wait here, shorter than the unbounded ones they replace.
PATIENCE = 20.0


def _child(code: str) -> subprocess.Popen[str]:
    """A Python child running ``code``; it prints ``ready`` once it holds what it takes."""
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def holders() -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(code: str) -> subprocess.Popen[str]:
        started.append(_child(code))
        return started[-1]

    yield start
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()


def _finishes(fn: Callable[[], object]) -> bool:
    """Run ``fn`` in a thread; whether it returned within PATIENCE seconds."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(PATIENCE)
    return not thread.is_alive()


HOLD_LEASE = """
    import sys, time
    from kernelcache.stores.lease import LeaseLock
    lock = LeaseLock({path!r})
    assert lock.acquire(5.0)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_put_behind_a_held_space_lease_gives_up(
    two_nodes: Callable[..., NetFS],
    holders: Callable[[str], subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller keeps its value, counted ``busy``, instead of waiting out the holder."""
    monkeypatch.setattr(tierlock, "LEASE_WAIT", 0.5)
    fs = two_nodes()
    disk = DiskStore(fs.nodes[0].path / "cache")
    assert disk.filesystem.network
    holders(HOLD_LEASE.format(path=disk.layout.space + ".lease"))
    cache = Cache([disk], persist_stats=False)
    got: list[bytes] = []

    def call() -> None:
        got.append(cache.get_or_compile("k" * 64, lambda: Entry({"a": b"value"}))["a"])

    assert _finishes(call)
    assert got == [b"value"]
    assert disk.counters.busy == 1
    assert disk.get("k" * 64) is None  # not stored: nothing half-done either
    cache.close()


def test_no_change_waits_for_another_process_s_cleaning(
    two_nodes: Callable[..., NetFS], holders: Callable[[str], subprocess.Popen[str]]
) -> None:
    """A cleaner elsewhere: this change goes on, and asks again at its next one."""
    fs = two_nodes()
    disk = DiskStore(fs.nodes[0].path / "cache", max_bytes=4096)
    holders(HOLD_LEASE.format(path=f"{disk.layout.locks}/cleaner.lease"))
    clean = disk.space.cleaner
    clean.run()  # in this thread: it is this thread's next change that asks again
    assert clean.pending  # the next change of this thread tries again
    disk.close()


def test_a_cleaner_hands_over_after_its_budget(
    two_nodes: Callable[..., NetFS], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts over the cap return before the eviction they started is done (it runs in a
    thread of its own, in batches of at most CLEAN_BUDGET seconds); each later change
    that finds the tier over cleans a batch more, so it ends under its cap.

    How far behind the cleaner is when the puts stop depends on how often its thread ran
    meanwhile (requests made while it runs coalesce into one more run): on a loaded
    machine, several batches. Each change after that is one batch (BATCH_MAX victims)."""
    monkeypatch.setattr(cleaner, "CLEAN_BUDGET", 0.0)  # one batch per run, then hand over
    fs = two_nodes()
    cap = 64 * 1024
    disk = DiskStore(fs.nodes[0].path / "cache", max_bytes=cap)
    for i in range(40):
        disk.put(f"{i:064x}", Entry({"a": os.urandom(4096)}))
    cleaner.finish()
    sizes = [disk.usage()[1]]
    # 40 entries of 4 KB over a 16-entry cap: at most 24 to evict, 4 batches of 6.
    for i in range(40 // cleaner.BATCH_MAX):
        if sizes[-1] <= cap:
            break
        disk.put(f"f{i:063x}", Entry({"a": b"x"}))  # a change over the cap: one batch
        cleaner.finish()
        sizes.append(disk.usage()[1])
    assert sizes[-1] <= cap, sizes
    assert all(later < earlier for earlier, later in itertools.pairwise(sizes)), sizes
    assert disk.counters.evictions > 0
    disk.close()


def test_a_statistics_flush_behind_a_slow_merge_keeps_its_counts(
    tmp_path: Path,
    holders: Callable[[str], subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernelcache.stats import totals

    monkeypatch.setattr(totals, "LOCK_WAIT", 0.2)
    cache_dir = tmp_path / "cache"
    cache = Cache([DiskStore(cache_dir)], settings=Settings.load(dir=str(cache_dir)))
    cache.get_or_compile("k" * 64, lambda: Entry({"a": b"x"}))
    lock = cache_dir / "v1" / "stats" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = holders(
        f"""
        import fcntl, os, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    assert _finishes(cache.flush_stats)
    assert read_totals(str(cache_dir))["lifetime"]["tiers"] == {}  # not merged yet
    holder.send_signal(signal.SIGKILL)
    holder.communicate()
    cache.get("k" * 64)
    cache.close()
    disk = read_totals(str(cache_dir))["lifetime"]["tiers"]["disk"]
    assert (disk["puts"], disk["hits"], disk["misses"]) == (1, 1, 1)


LEAVE = """
    import os, sys
    from kernelcache import Entry
    from kernelcache.stores import DiskStore
    from kernelcache.stores.disk import space

    def die(*args, **kwargs):
        os._exit(9)  # killed between writing the staged entry and publishing it

    DiskStore.pack_max = 0  # an entry file, staged (a packed entry is never staged)
    disk = DiskStore({path!r})
    space.Space.publish = die
    print("ready", flush=True)
    disk.put("{key}", Entry({{"a": b"x" * 100}}))
"""


@pytest.fixture
def leave(tmp_path: Path) -> Callable[[str], list[str]]:
    """Kill a process of this node in the middle of a put; what it left in staging."""

    def run(key: str) -> list[str]:
        proc = _child(LEAVE.format(path=str(tmp_path / "cache"), key=key))
        proc.communicate()
        assert proc.returncode == 9
        return os.listdir(tmp_path / "cache" / "v1" / "staging")

    return run


def test_what_a_gone_process_left_in_staging_goes_at_the_next_open(
    tmp_path: Path, leave: Callable[[str], list[str]]
) -> None:
    assert leave("a" * 64)
    DiskStore(tmp_path / "cache").close()
    assert os.listdir(tmp_path / "cache" / "v1" / "staging") == []


def test_what_a_gone_process_left_in_staging_goes_at_the_next_put(
    tmp_path: Path, leave: Callable[[str], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "SWEEP_INTERVAL", 0.0)  # a put sweeps again at once
    disk = DiskStore(tmp_path / "cache")
    assert leave("b" * 64)
    disk.put("c" * 64, Entry({"a": b"y"}))
    assert os.listdir(tmp_path / "cache" / "v1" / "staging") == []
    disk.close()


def test_a_live_writer_s_staging_file_stays(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path / "cache")
    mine = Path(disk.layout.staged("k") + ".tmp")
    mine.write_bytes(b"being written")
    other = Path(disk.layout.staged("k").replace(f"-{os.getpid()}.", "-1.") + ".tmp")
    other.write_bytes(b"pid 1 is alive")
    disk.sweep()
    assert mine.exists()
    assert other.exists()
    disk.close()


def test_a_writer_in_another_pid_namespace_is_not_judged_by_this_one_s_pids(
    tmp_path: Path,
) -> None:
    # Containers on one host with the host's network share its name and boot id, not its
    # pids: a live writer's pid there may be no process here (review). Its staging names
    # carry another node tag, so this node's sweep leaves them alone.
    from kernelcache.stores.disk import layout

    code = "from kernelcache.stores.disk import layout; print(layout._NODE)"
    try:
        proc = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": SRC},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if proc.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {proc.stderr.strip()}")
    theirs = proc.stdout.strip()
    ours = layout._NODE  # noqa: SLF001
    assert theirs != ours
    done = subprocess.Popen(["true"])
    done.wait()  # a pid that is no process of this namespace
    disk = DiskStore(tmp_path / "cache")
    name = disk.layout.staged("k").replace(f"{ours}-{os.getpid()}.", f"{theirs}-{done.pid}.")
    other = Path(name + ".tmp")
    other.write_bytes(b"a live writer in another container")
    disk.sweep()
    assert other.exists()
    disk.close()
