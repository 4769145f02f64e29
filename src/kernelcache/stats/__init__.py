"""Statistics: a Cache's per-process counts (``recorder.py``), the totals every process
merges into the cache directory (``totals.py``) and the launcher's counters
(``launcher.py``)."""

from __future__ import annotations

from kernelcache.stats.recorder import FLUSH_INTERVAL, HIT_SAMPLE, Recorder, persistent_dir

__all__ = ["FLUSH_INTERVAL", "HIT_SAMPLE", "Recorder", "persistent_dir"]
