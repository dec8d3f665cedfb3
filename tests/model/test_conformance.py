"""The checker of recorded fault runs (model/conformance.py) passes a run the model allows and
rejects a hand-made bad log for each of its rules: the red cases.

The good run has what the fault runs have: a relay that published a batch twice (killed
between the confirm and the mark), a copy absorbed by the inbox, a worker killed after a
handler ran (the message run again elsewhere, a claim counted for each run), a key's two
messages in order. Each bad log changes that run in one place.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from e2e.apps import EventLog

from model.conformance import RULES, Event, Message, Run, check, conforming, read_events

A, B, C = "a", "b", "c"  # A and C share key k (A first); B has none
RELAY1, RELAY2, RECEIVER, WORKER1, WORKER2 = 11, 12, 21, 31, 32


def good() -> Run:
    log = [
        (RELAY1, "confirmed", A, "confirmed"),
        (RELAY1, "confirmed", B, "confirmed"),
        # relay 1 killed before its mark: relay 2 publishes both again
        (RELAY2, "confirmed", A, "confirmed"),
        (RELAY2, "confirmed", B, "confirmed"),
        (RELAY2, "marked", A, ""),
        (RELAY2, "marked", B, ""),
        (RECEIVER, "stored", A, ""),
        (RECEIVER, "stored", B, ""),
        (WORKER1, "ran", A, "ok"),
        (WORKER1, "ran", B, "ok"),  # killed here: the batch never committed
        (WORKER2, "ran", A, "ok"),
        (WORKER2, "ran", B, "ValueError"),
        (WORKER2, "ran", A, "ok"),  # the batch run again one by one, B's failure recorded
        (WORKER2, "retry", B, ""),
        (WORKER2, "processed", A, ""),
        (RELAY2, "confirmed", C, "confirmed"),
        (RELAY2, "marked", C, ""),
        (RECEIVER, "stored", C, ""),
        (WORKER2, "ran", B, "ok"),
        (WORKER2, "ran", C, "ok"),
        (WORKER2, "processed", B, ""),
        (WORKER2, "processed", C, ""),
    ]
    events = [Event(10 * i, pid, e, m, x) for i, (pid, e, m, x) in enumerate(log)]
    messages = {
        A: Message(order=1, key="k", status="processed", attempts=2, finished=1, effects=1),
        B: Message(order=2, status="processed", attempts=3, finished=2, effects=1),
        C: Message(order=3, key="k", status="processed", attempts=1, finished=1, effects=1),
    }
    return Run("good", ("kill",), messages, events)


D, E = "d", "e"


def dead_ends(run: Run) -> Run:
    """`run` (the good one) with the other ends: D refused by its handler, dead (rejected);
    E dead-lettered by the receiver past max_redeliveries, never stored; and C's inbox row
    dropped by retention once it was processed and marked, no copy on its way."""
    log = [
        (RELAY2, "confirmed", D, "confirmed"),
        (RELAY2, "confirmed", E, "confirmed"),
        (RELAY2, "marked", D, ""),
        (RELAY2, "marked", E, ""),
        (RECEIVER, "stored", D, ""),
        (WORKER2, "ran", D, "Reject"),
        (WORKER2, "dead", D, ""),
    ]
    events = [*run.events, *(Event(300 + 10 * i, *e) for i, e in enumerate(log))]
    messages = {
        **run.messages,
        C: replace(run.messages[C], status=None, dropped=1000),
        D: Message(
            order=4, status="dead", attempts=1, finished=1, faults=1, dead_reason="rejected"
        ),
        E: Message(order=5, status=None, deliveries=6, dead_lettered=1),
    }
    return replace(
        run, events=events, messages=messages, max_attempts=3, abandon_after=3, max_redeliveries=5
    )


def rules(run: Run) -> set[str]:
    return {rule for rule, _ in check(run).violations}


def edit(run: Run, drop: int | None = None, add: tuple[int, str, str, str] | None = None) -> Run:
    """`run` with its `drop`-th event left out, or `add` (pid, event, message, detail) put
    after its last event."""
    events = [e for i, e in enumerate(run.events) if i != drop]
    if add is not None:
        events.append(Event(10 * len(run.events), *add))
    return replace(run, events=events)


def insert(run: Run, t: int, pid: int, event: str, mid: str) -> Run:
    """`run` with an event at time `t` (the good run's i-th event is at 10 i)."""
    return replace(
        run, events=sorted([*run.events, Event(t, pid, event, mid, "ok")], key=lambda e: e.t)
    )


def with_message(run: Run, mid: str, **changes: object) -> Run:
    return replace(run, messages={**run.messages, mid: replace(run.messages[mid], **changes)})


def test_the_good_run_conforms_and_its_premises_are_counted() -> None:
    replay = check(good())
    assert replay.conforms, replay.report()
    assert replay.premises["run-ends"] == 2  # worker 1's two runs, ended by its kill
    assert replay.premises["key-order"] == 1
    assert replay.premises["claim-counted"] >= 2


def test_a_dead_mark_a_dead_letter_and_a_dropped_row_conform() -> None:
    replay = check(dead_ends(good()))
    assert replay.conforms, replay.report()
    for rule in ("dead-once", "dead-reason", "dead-lettered", "dropped-finished"):
        assert replay.premises[rule] == 1, rule
    assert replay.premises["key-order"] == 1  # C, though its row is gone


RED = {
    # an effect twice (a handler writing outside its transaction, run again after a kill)
    "exactly-once-effect": lambda r: with_message(r, A, effects=2),
    "no-effect-without-commit": lambda r: with_message(r, B, committed=False),
    "only-committed-leave": lambda r: edit(r, add=(RECEIVER, "stored", "ghost", "")),
    "marked-after-confirm": lambda r: edit(r, add=(RELAY1, "marked", C, "")),
    "stored-once": lambda r: edit(r, add=(RECEIVER, "stored", A, "")),
    # handled without stored
    "run-after-stored": lambda r: with_message(edit(r, drop=17), C, status=None),
    # the claim counted in the handler's transaction: rolled back with the killed run
    "claim-counted": lambda r: with_message(r, A, attempts=1),
    # worker 1 runs B while worker 2's run of it has not ended
    "one-holder": lambda r: insert(r, 125, WORKER1, "ran", B),
    "no-run-after-processed": lambda r: edit(r, add=(WORKER1, "ran", A, "ok")),
    "dead-has-no-effect": lambda r: with_message(r, C, status="dead", faults=1),
    # dead without its fault (written outside the dead mark's transaction, lost with it)
    "dead-sends-its-fault": lambda r: with_message(r, C, status="dead", effects=0),
    # key order broken: C runs before A finished
    "key-order": lambda r: insert(r, 85, WORKER1, "ran", C),
    "run-ends": lambda r: replace(r, faults=("duplicate",)),
    # D run again after its dead mark (a claim that did not check the status)
    "dead-once": lambda r: insert(dead_ends(r), 400, WORKER1, "ran", D),
    # max_attempts counted from one attempt
    "dead-reason": lambda r: with_message(dead_ends(r), D, dead_reason="max_attempts"),
    # dead-lettered on its second delivery
    "dead-lettered": lambda r: with_message(dead_ends(r), E, deliveries=2),
    # C's partition dropped while C was still running
    "dropped-finished": lambda r: with_message(dead_ends(r), C, dropped=195),
    # a copy of C published after its row was dropped (retention shorter than the window)
    "dropped-outside-window": lambda r: insert(dead_ends(r), 1010, RELAY1, "confirmed", C),
    "finished": lambda r: with_message(r, C, status="pending"),
}


def test_every_rule_has_a_red_case() -> None:
    assert set(RED) == set(RULES)


@pytest.mark.parametrize("rule", sorted(RED))
def test_a_bad_log_is_rejected_on_its_rule(rule: str) -> None:
    bad = RED[rule](good())
    found = rules(bad)
    assert rule in found, check(bad).report()


def test_an_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="FAULT_KINDS"):
        check(replace(good(), faults=("solar-flare",)))


def test_the_event_log_written_by_the_role_listener_reads_back(tmp_path: Path) -> None:
    from outbox_inbox.messages import Message as Delivered

    log = EventLog(tmp_path)
    message = Delivered(message_id=uuid.uuid4(), kind="command", type="x.y", payload={})
    log.stored([message])
    log.handler_ran(message, 0.1, ValueError("no"))
    log.failed(message, ValueError("no"), dead=False)
    (tmp_path / "cut.jsonl").write_text(json.dumps({"t": 0}))  # a line cut by a SIGKILL
    events = read_events(tmp_path)
    assert [(e.event, e.detail) for e in events] == [
        ("stored", ""),
        ("ran", "ValueError"),
        ("retry", ""),
    ]
    assert {e.message for e in events} == {str(message.message_id)}


def test_with_sessions_cut_a_claim_given_back_may_be_uncounted_a_killed_one_may_not() -> None:
    cut = replace(good(), faults=("kill", "terminate-sessions"))
    # worker 3 runs C, its session is cut, it gives the claim back (uncounted) and goes on
    # with D; C's one counted claim is worker 2's
    worker3, d = 33, "d"
    released = insert(cut, 175, worker3, "ran", C)
    for t, (pid, event) in enumerate(
        [(RELAY2, "confirmed"), (RELAY2, "marked"), (RECEIVER, "stored"), (worker3, "ran")]
    ):
        released = insert(released, 220 + t, pid, event, d)
    released = insert(released, 230, worker3, "processed", d)
    released.events = [
        replace(e, detail="confirmed") if e.event == "confirmed" else e for e in released.events
    ]
    released.messages[d] = Message(order=4, status="processed", attempts=1, effects=1)
    assert check(released).conforms, check(released).report()
    # worker 1 was killed after running A: that claim was counted whatever the sessions did
    assert "claim-counted" in rules(with_message(cut, A, attempts=1))


def test_a_run_with_no_fault_or_a_buggy_service_does_not_count_toward_coverage() -> None:
    faulted, quiet, buggy = check(good()), check(replace(good(), faults=())), check(good())
    buggy.broken = True
    assert not quiet.counts  # (and it does not conform: its worker was killed by no fault)
    assert conforming([faulted, quiet, buggy]) == (1, 1)
