"""The circuit breaker on its own: closed, open, one probe, closed again."""

from __future__ import annotations

import time

import pytest

from kernelcache.stores.redis.breaker import CircuitBreaker


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


def test_lets_one_probe_through_after_the_cooldown() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=0.05)
    assert breaker.record_failure()
    assert not breaker.allow()
    time.sleep(0.06)
    assert breaker.allow()
    assert breaker.state == "half-open"
    assert not breaker.allow()  # one probe at a time
    assert breaker.record_failure()
    assert breaker.trips == 2  # probe failed: open again
    time.sleep(0.06)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert breaker.allow()


def test_a_probe_that_never_reports_does_not_wedge_it_open() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=0.05)
    breaker.record_failure()
    time.sleep(0.06)
    assert breaker.allow()  # this probe's caller vanishes without reporting
    time.sleep(0.06)
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
