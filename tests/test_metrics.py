"""``kernelcache stats --format openmetrics`` read by prometheus_client's own parser, and the
per-day view of seconds saved (issue 38)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from cli_run import kc, kc_json
from disk_entries import damage_every_entry
from kernelcache.cache import Cache
from kernelcache.entry import Entry
from kernelcache.keys import KeyBuilder
from kernelcache.settings import Settings
from kernelcache.stats import launcher, totals
from kernelcache.stores.disk import DiskStore
from kernelcache.stores.memory import MemoryStore


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with two compiles and three hits of one family, a corrupt entry, and
    launcher calls (one uncacheable with its reason)."""
    root = tmp_path_factory.mktemp("metrics") / "cache"
    keys = [KeyBuilder("kernelcache.demo").add("n", n).hexdigest() for n in range(2)]
    with Cache([MemoryStore(), DiskStore(root)]) as cache:
        for key in keys:
            cache.get_or_compile(key, lambda: Entry({"x": b"1" * 100}))
    with Cache([DiskStore(root)]) as cache:  # another process would start cold: disk hits
        took = [cache.get(key).meta["compile_seconds"] for key in keys]  # type: ignore[union-attr]
        assert cache.get(keys[0]) is not None
    (root.parent / "took.json").write_text(json.dumps(took))
    bad = KeyBuilder("kernelcache.demo").add("n", "bad").hexdigest()
    with Cache([DiskStore(root)]) as cache:
        cache.put(bad, Entry({"x": b"2"}))
        # A file or a packed record (stores/disk/pack.py): its last byte damaged in place.
        assert damage_every_entry(root, lambda data: data[:-1] + b"!", {bad}) == 1
        assert cache.get(bad) is None  # corrupt: a miss with its reason
    settings = Settings.load(environ={}, dir=str(root))
    launcher.count(settings, "hits", saved=1.5)
    launcher.count(settings, "uncacheable", reason="preprocessing (-E)")
    return root


def _metrics(root: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = kc("stats", "--format", "openmetrics", env={"KERNELCACHE_DIR": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("# EOF\n")
    samples = {}
    for family in text_string_to_metric_families(out.stdout):  # type: ignore[no-untyped-call]
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _saved(busy: Path) -> float:
    """What the three hits saved: the first key's compile twice, the second's once."""
    took = json.loads((busy.parent / "took.json").read_text())
    return float(2 * took[0] + took[1])


def test_openmetrics_parses_and_counts_per_tier_and_integration(busy: Path) -> None:
    got = _metrics(busy)
    saved = _saved(busy)
    assert got["kernelcache_tier_hits_total", (("tier", "disk"),)] == 3
    assert got["kernelcache_tier_seconds_saved_total", (("tier", "disk"),)] == pytest.approx(saved)
    assert got["kernelcache_integration_compiles_total", (("integration", "demo"),)] == 2
    assert got["kernelcache_integration_hits_total", (("integration", "demo"),)] == 3
    family_saved = got["kernelcache_integration_seconds_saved_total", (("integration", "demo"),)]
    assert family_saved == pytest.approx(saved)
    assert got["kernelcache_integration_misses_total", (("integration", "demo"),)] == 3
    assert got["kernelcache_misses_by_reason_total", (("reason", "corrupt"), ("tier", "disk"))] == 1
    reason = (("reason", "uncacheable: preprocessing (-E)"), ("tier", "launcher"))
    assert got["kernelcache_misses_by_reason_total", reason] == 1
    assert got["kernelcache_launcher_calls_total", (("outcome", "hits"),)] == 1
    assert got["kernelcache_launcher_seconds_saved_total", ()] == 1.5
    assert got["kernelcache_compiles_total", ()] == 2
    assert got["kernelcache_stored_entries", (("tier", "disk"),)] == 2


def test_seconds_saved_per_day(busy: Path, tmp_path: Path) -> None:
    env = {"KERNELCACHE_DIR": str(busy)}
    (today,) = kc_json("stats", "--days", "7", env=env)
    assert (today["hits"], today["compiles"]) == (3 + 1, 2)  # the cache's and the launcher's
    assert today["seconds_saved"] == pytest.approx(_saved(busy) + 1.5)
    text = kc("stats", "--days", env=env).stdout
    assert today["date"] in text
    assert "█" * 40 in text  # the best day fills the chart
    # Days already in the file: the table and chart show each, the oldest dropped past the limit.
    doc: dict[str, Any] = json.loads(
        (Path(totals.stats_dir(str(busy))) / "totals.json").read_text()
    )
    half = doc["days"][today["date"]]["seconds_saved"] / 2  # the copy has no launcher calls
    doc["days"]["2026-01-01"] = {"seconds_saved": half, "hits": 1}
    copy = tmp_path / "cache"
    os.makedirs(totals.stats_dir(str(copy)))
    (Path(totals.stats_dir(str(copy))) / "totals.json").write_text(json.dumps(doc))
    (copy / "v1").chmod(0o700)
    rows = [r["date"] for r in kc_json("stats", "--days", "2", env={"KERNELCACHE_DIR": str(copy)})]
    assert rows == ["2026-01-01", today["date"]]
    lines = kc("stats", "--days", env={"KERNELCACHE_DIR": str(copy)}).stdout.splitlines()
    assert lines[1].endswith(" " + "█" * 20)  # half the best day's seconds: half the bar
    assert totals.MAX_DAYS >= 365


def test_a_damaged_families_section_is_damage(tmp_path: Path) -> None:
    folder = Path(totals.stats_dir(str(tmp_path)))
    folder.mkdir(parents=True)
    lifetime = totals.new_section()
    lifetime["families"] = {"demo": {"hits": "many"}}
    doc = {"version": 1, "lifetime": lifetime, "period": totals.new_section()}
    (folder / "totals.json").write_text(json.dumps(doc))
    assert totals.read_totals(str(tmp_path))["damaged"] is True
