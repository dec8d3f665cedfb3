from __future__ import annotations

import pytest

from outbox_inbox import ConfigurationError, InvalidPayload, Reject, Retry, RetryPolicy
from outbox_inbox.retry import Dead, Later


def test_delay_grows_exponentially_and_is_capped_by_max_interval() -> None:
    policy = RetryPolicy(initial=1, multiplier=2, max_interval=10, max_attempts=10)
    assert [policy.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_jitter_stays_within_its_fraction() -> None:
    policy = RetryPolicy(initial=10, multiplier=1, max_interval=10, jitter=0.2)
    delays = [policy.delay(1) for _ in range(200)]
    assert all(8 <= d <= 12 for d in delays)
    assert len(set(delays)) > 1


@pytest.mark.parametrize(("max_attempts", "last"), [(0, 1), (1, 1), (3, 3)])
def test_gives_up_after_max_attempts_and_zero_means_no_retry(max_attempts: int, last: int) -> None:
    policy = RetryPolicy(max_attempts=max_attempts)
    assert not policy.gives_up_after(last - 1) or last == 1
    assert policy.gives_up_after(last)


@pytest.mark.parametrize(
    "kwargs",
    [{"initial": -1}, {"multiplier": 0.5}, {"max_attempts": -1}, {"jitter": 1.0}],
)
def test_invalid_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "attempt", "decision"),
    [
        (ValueError("boom"), 1, Later(2.0)),
        (ValueError("boom"), 2, Later(4.0)),
        (ValueError("boom"), 3, Dead("max_attempts")),
        (Retry(delay=30), 2, Later(30)),  # the handler's delay, not the policy's
        (Retry(), 1, Later(2.0)),
        (Retry(delay=30), 3, Dead("max_attempts")),  # a handler's Retry cannot pass the last
        (Reject("never"), 1, Dead("rejected")),
        (InvalidPayload("not an order"), 1, Dead("invalid_payload")),
    ],
)
def test_the_policy_decides_each_failure(exc: Exception, attempt: int, decision: object) -> None:
    policy = RetryPolicy(initial=2, multiplier=2, max_interval=60, max_attempts=3)
    assert policy.decide(exc, attempt) == decision
