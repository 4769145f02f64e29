"""Values the Redis tier leaves in place but will not pay for again soon."""

from __future__ import annotations

import threading
import time

#: A bad value that is left in place (forged, over this reader's limits, or the tier
#: is read-only) is not looked up again for this long.
BAD_SECONDS = 300.0
_BAD_MAX = 4096


class BadValues:
    """Names of values left in place that lookups skip for a while (thread-safe, bounded)."""

    def __init__(self, seconds: float = BAD_SECONDS, limit: int = _BAD_MAX) -> None:
        self.seconds = seconds
        self.limit = limit
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def holds(self, name: str) -> bool:
        until = self._until.get(name)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        self.discard(name)
        return False

    def add(self, name: str) -> None:
        with self._lock:
            if len(self._until) >= self.limit:
                self._until.pop(next(iter(self._until)))  # the oldest
            self._until[name] = time.monotonic() + self.seconds

    def discard(self, name: str) -> None:
        with self._lock:
            self._until.pop(name, None)
