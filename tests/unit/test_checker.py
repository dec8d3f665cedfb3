"""The fault kit's checker sorts every expected and found effect into its category."""

from __future__ import annotations

import pytest

from outbox_inbox.testing.checker import FAILED, OK, UNKNOWN, History, check


def _history() -> History:
    history = History()
    history.record([1, 2], OK)
    history.record([3], OK)
    history.record([4], UNKNOWN)  # committed after all: its effect is found
    history.record([5], UNKNOWN)  # not committed: no effect
    history.record([6], FAILED)  # rolled back
    return history


def test_a_run_where_every_committed_effect_is_found_once_is_valid() -> None:
    verdict = check(_history(), [1, 2, 3, 4])
    assert verdict.valid
    assert verdict.committed == 3
    assert verdict.recovered == {4}
    assert verdict.unknown == 1
    assert verdict.transactions == {OK: 2, UNKNOWN: 2, FAILED: 1}
    assert verdict.report().startswith("valid: transactions 2 ok, 2 unknown, 1 failed")


def test_a_committed_effect_not_found_is_lost() -> None:
    verdict = check(_history(), [1, 3, 4])
    assert not verdict.valid and verdict.lost == {2}
    assert "lost 1  e.g. 2" in verdict.report()


def test_an_effect_found_twice_is_duplicated() -> None:
    verdict = check(_history(), [1, 2, 3, 3, 4, 4])
    assert not verdict.valid and verdict.duplicated == {3: 2, 4: 2}


def test_the_effect_of_a_rolled_back_or_unknown_transaction_is_unexpected() -> None:
    verdict = check(_history(), [1, 2, 3, 6, 99])
    assert not verdict.valid and verdict.unexpected == {6, 99}
    assert verdict.lost == frozenset() and verdict.recovered == frozenset()


def test_faults_carry_their_recovery_time_into_the_report() -> None:
    history = _history()
    fault = history.begin_fault("postgres-restart")
    history.end_fault(fault)
    fault.recovered_s = 1.25
    lines = check(history, [1, 2, 3]).report().splitlines()
    assert lines[-1].startswith("fault postgres-restart: lasted 0.0 s, recovered in 1.2 s")


def test_expected_until_a_time_takes_only_what_was_recorded_by_then() -> None:
    history = History()
    history.record(["early"], OK)
    fault = history.begin_fault("f")
    history.record(["late"], OK)
    assert history.expected(OK, until=fault.began) == {"early"}


def test_an_unknown_outcome_name_is_refused() -> None:
    with pytest.raises(ValueError, match="outcome must be one of"):
        History().record([1], "committed")


def test_a_fault_outside_the_load_refuses_the_verdict() -> None:
    history = History()
    before = history.begin_fault("kill")  # nothing written before its end
    history.end_fault(before)
    history.record([1], OK)
    inside = history.begin_fault("postgres-restart")
    history.record([2], UNKNOWN)
    history.end_fault(inside)
    history.record([3], OK)
    after = history.begin_fault("rabbitmq-restart")  # nothing committed after it
    history.end_fault(after)
    verdict = check(history, [1, 3])
    assert not verdict.valid and not (verdict.lost or verdict.duplicated or verdict.unexpected)
    assert [r.split(" did not")[0] for r in verdict.refused] == [
        "fault kill",
        "fault rabbitmq-restart",
    ]
    assert "REFUSED: fault kill did not overlap the load" in verdict.report()
