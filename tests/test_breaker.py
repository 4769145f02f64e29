"""The circuit breaker on its own: closed, open, one probe, closed again."""

from __future__ import annotations

import pytest

from kernelcache.stores.redis import breaker as breaker_module
from kernelcache.stores.redis.breaker import CircuitBreaker


class Clock:
    """The breaker's monotonic clock, moved only by the test: "not yet" assertions within a
    cooldown hold however long a loaded machine stalls this process between two lines."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(breaker_module, "time", clock)
    return clock


def test_opens_after_threshold_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown=60)
    assert not breaker.record_failure()
    assert not breaker.record_failure()
    breaker.record_success()  # not consecutive: start over
    assert not breaker.record_failure()
    assert not breaker.record_failure()
    assert breaker.allow()
    assert breaker.state == "closed"
    assert breaker.record_failure()
    assert breaker.state == "open"
    assert not breaker.allow()
    assert breaker.trips == 1


def test_lets_one_probe_through_after_the_cooldown(clock: Clock) -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=0.05)
    assert breaker.record_failure()
    clock.sleep(0.04)
    assert not breaker.allow()
    clock.sleep(0.02)
    assert breaker.allow()
    assert breaker.state == "half-open"
    clock.sleep(0.04)
    assert not breaker.allow()  # one probe at a time
    assert breaker.record_failure()
    assert breaker.trips == 2  # probe failed: open again
    clock.sleep(0.04)
    assert not breaker.allow()  # a whole cooldown again
    clock.sleep(0.02)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert breaker.allow()


def test_a_probe_that_never_reports_does_not_wedge_it_open(clock: Clock) -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=0.05)
    breaker.record_failure()
    clock.sleep(0.06)
    assert breaker.allow()  # this probe's caller vanishes without reporting
    clock.sleep(0.04)
    assert not breaker.allow()
    clock.sleep(0.02)
    assert breaker.allow()


def test_stragglers_failing_after_it_opened_do_not_count_as_trips() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=60)
    assert breaker.record_failure()
    assert not breaker.record_failure()
    assert breaker.trips == 1


@pytest.mark.parametrize(
    ("threshold", "cooldown", "named"),
    [(0, 1.0, "threshold"), (1.5, 1.0, "threshold"), (1, -1.0, "cooldown")],
)
def test_rejects_nonsense_settings(threshold: object, cooldown: float, named: str) -> None:
    with pytest.raises(ValueError, match=f"breaker {named} must be"):
        CircuitBreaker(threshold, cooldown)  # type: ignore[arg-type]
