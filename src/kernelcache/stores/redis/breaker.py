"""A circuit breaker: skip a failing backend for a while instead of paying its timeout each call.

States: *closed* (calls go through) → after ``threshold`` consecutive failures,
*open* for ``cooldown`` seconds (calls are refused at once) → then one probe
call is let through: success closes the breaker, failure opens it again.

A remote cache that is down must cost a build almost nothing: without a
breaker every lookup of a long build waits out the connect timeout (sccache
and ccache users report builds slowed to a crawl by an unreachable remote).
"""

from __future__ import annotations

import threading
import time


class CircuitBreaker:
    """Thread-safe; ``allow`` is lock-free while the breaker is closed (the hot path)."""

    def __init__(self, threshold: int = 3, cooldown: float = 10.0) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"breaker threshold must be a positive int, not {threshold!r}")
        if not cooldown >= 0:
            raise ValueError(f"breaker cooldown must be >= 0 seconds, not {cooldown!r}")
        self.threshold = threshold
        self.cooldown = float(cooldown)
        #: How many times the breaker opened.
        self.trips = 0
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"`` (a probe is in flight)."""
        if self._open_until is None:
            return "closed"
        return "half-open" if self._probing else "open"

    def allow(self) -> bool:
        """Whether a call may go to the backend now."""
        if self._open_until is None:
            return True
        with self._lock:
            if self._open_until is None:
                return True
            now = time.monotonic()
            if now < self._open_until:
                return False
            # One probe per cooldown: if the probe never reports back (its
            # caller crashed), another one is let through a cooldown later.
            self._open_until = now + self.cooldown
            self._probing = True
            return True

    def record_success(self) -> None:
        if self._failures or self._open_until is not None:
            with self._lock:
                self._failures = 0
                self._open_until = None
                self._probing = False

    def record_failure(self) -> bool:
        """Count a failure; ``True`` if this one opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._open_until is not None and not self._probing:
                return False  # a call that started before the breaker opened
            if self._probing or self._failures >= self.threshold:
                self._open_until = time.monotonic() + self.cooldown
                self._probing = False
                self.trips += 1
                return True
            return False
