"""Batch handlers and deferred writes: one call (or one statement) per claimed batch, exactly
once per message, and a failure that falls back to one message at a time, so that one bad
message never takes its batch-mates with it. On real PostgreSQL and RabbitMQ;
``effects.message_id`` is unique, so a second effect of a message fails its transaction
instead of passing unseen."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Column, MetaData, String, Table, event, insert, text
from sqlalchemy.orm import Session

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import (
    BatchContext,
    HandlerContext,
    Listener,
    Message,
    Reject,
    Retry,
    RetryPolicy,
    Service,
)

INBOX = "outbox_inbox.inbox_messages"


def _write(session: Session, messages: Sequence[Message], info: Any = None) -> None:
    """The effects of a batch: one multi-row INSERT."""
    session.execute(
        text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
        [{"m": str(m.message_id), "t": m.type, "i": json.dumps(info)} for m in messages],
    )


def _fill_inbox(
    billing: Service,
    db_url: str,
    payloads: list[dict[str, Any]],
    keys: list[str] | None = None,
    **send: Any,
) -> list[str]:
    """Send `payloads` (with `keys`) to billing itself and wait until every one is in its
    inbox, pending, so that the worker claims them in full batches."""
    billing.declare_topology()
    before = scalar(db_url, f"SELECT count(*) FROM {INBOX}")
    with billing.session() as session, session.begin():
        ids = [
            str(
                billing.outbox.send(
                    session, "billing", "ledger.append", p, key=keys[n] if keys else None, **send
                )
            )
            for n, p in enumerate(payloads)
        ]
    with running(billing.relay(), billing.receiver()):
        wait_until(
            lambda: scalar(db_url, f"SELECT count(*) FROM {INBOX}") == before + len(ids),
            what="the inbox to fill",
        )
    return ids


def _handle_all(billing: Service, db_url: str, count: int, timeout: float = 30) -> None:
    settled = f"SELECT count(*) FROM {INBOX} WHERE status IN ('processed', 'dead')"
    with running(billing.worker()):
        wait_until(lambda: scalar(db_url, settled) == count, timeout=timeout, what="all settled")


def _states(db_url: str) -> dict[str, tuple[str, int, int, str | None]]:
    return {
        r.message_id: (r.status, r.attempts, r.finished, r.dead_reason)
        for r in rows(
            db_url,
            f"SELECT message_id::text, status, attempts, finished, dead_reason FROM {INBOX}",
        )
    }


def _effects(db_url: str) -> list[str]:
    return sorted(m for (m,) in rows(db_url, "SELECT message_id FROM effects"))


def test_a_batch_handler_gets_whole_claimed_batches_and_each_message_is_handled_once(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)
    sizes: list[int] = []

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session) -> None:
        sizes.append(len(messages))
        _write(session, messages)

    ids = _fill_inbox(billing, db_url, [{"n": n} for n in range(120)])
    _handle_all(billing, db_url, 120)
    assert sizes == [50, 50, 20]
    assert _effects(db_url) == sorted(ids)
    assert set(_states(db_url).values()) == {("processed", 1, 1, None)}
    billing.close()


def test_one_poison_among_50_is_dead_alone_and_its_49_batch_mates_are_handled_once(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)
    calls: list[int] = []

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session) -> None:
        calls.append(len(messages))
        _write(session, messages)  # written, then rolled back with the batch
        for message in messages:
            if message.payload.get("bad"):
                raise Reject("bad input")

    payloads: list[dict[str, Any]] = [{"n": n} for n in range(50)]
    payloads[17]["bad"] = True
    ids = _fill_inbox(billing, db_url, payloads)
    _handle_all(billing, db_url, 50)

    # The batch, then each message alone in a savepoint of its own.
    assert calls == [50] + [1] * 50
    states = _states(db_url)
    assert states.pop(ids[17]) == ("dead", 1, 1, "rejected")
    assert set(states.values()) == {("processed", 1, 1, None)}
    assert _effects(db_url) == sorted(i for i in ids if i != ids[17])
    billing.close()


def test_a_retry_in_the_middle_of_a_batch_retries_that_message_alone(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)
    seen: list[tuple[int, int]] = []  # (n, attempt) of each message each call saw

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session) -> None:
        seen.extend((m.payload["n"], m.attempt) for m in messages)
        for message in messages:
            if message.payload["n"] == 25 and message.attempt == 1:
                raise Retry(delay=0.2)
        _write(session, messages)

    ids = _fill_inbox(billing, db_url, [{"n": n} for n in range(50)])
    _handle_all(billing, db_url, 50)

    states = _states(db_url)
    assert states.pop(ids[25]) == ("processed", 2, 2, None)
    assert set(states.values()) == {("processed", 1, 1, None)}
    assert _effects(db_url) == sorted(ids)
    assert seen.count((25, 1)) == 2  # in the batch, then alone: the same failure
    assert seen.count((25, 2)) == 1
    billing.close()


def test_a_failing_head_holds_its_key_and_keys_keep_their_order_in_batches(
    db_url: str, mq_url: str
) -> None:
    billing = make_service(
        "billing",
        db_url,
        mq_url,
        worker_batch_size=50,
        retry=RetryPolicy(initial=0.1, multiplier=1, max_attempts=5),
    )
    order: list[tuple[str, int]] = []

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session) -> None:
        keys = [m.key for m in messages]
        assert len(keys) == len(set(keys)), "two messages of one key in a batch"
        for message in messages:
            if message.key == "k0" and message.payload["seq"] == 0 and message.attempt < 3:
                raise RuntimeError("the head of k0 fails twice")
        order.extend((str(m.key), m.payload["seq"]) for m in messages)
        _write(session, messages)

    sent = [(key, seq) for key in ("k0", "k1", "k2") for seq in range(6)]
    ids = _fill_inbox(billing, db_url, [{"seq": s} for _, s in sent], keys=[k for k, _ in sent])
    _handle_all(billing, db_url, 18)

    for key in ("k0", "k1", "k2"):
        assert [s for k, s in order if k == key] == list(range(6)), order
    assert len(order) == 18 and _effects(db_url) == sorted(ids)
    # k0's messages came only after its head succeeded (on its third attempt).
    assert set(_states(db_url).values()) >= {("processed", 3, 3, None)}
    billing.close()


@dataclass
class Entry:
    account: str
    cents: int


def test_batch_payloads_are_decoded_and_an_invalid_one_is_dead_alone(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session, payloads: list[Entry]) -> None:
        assert all(isinstance(p, Entry) for p in payloads)
        for message, payload in zip(messages, payloads, strict=True):
            _write(session, [message], [payload.account, payload.cents])

    payloads: list[dict[str, Any]] = [{"account": f"a{n}", "cents": n} for n in range(10)]
    payloads[4] = {"account": "a4", "cents": "four"}
    ids = _fill_inbox(billing, db_url, payloads)
    _handle_all(billing, db_url, 10)

    states = _states(db_url)
    assert states.pop(ids[4]) == ("dead", 1, 1, "invalid_payload")
    assert set(states.values()) == {("processed", 1, 1, None)}
    effects = {r.message_id: json.loads(r.info) for r in rows(db_url, "SELECT * FROM effects")}
    assert effects == {ids[n]: [f"a{n}", n] for n in range(10) if n != 4}
    billing.close()


def test_a_batch_context_publishes_each_reply_with_its_own_messages_ids(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)

    @billing.on_command("ledger.append", batch=True)
    def append(batch: BatchContext) -> None:
        _write(batch.session, batch.messages)
        for ctx in batch:
            ctx.publish("ledger.appended", {"n": ctx.payload["n"]})

    ids = _fill_inbox(billing, db_url, [{"n": n} for n in range(5)], correlation_id="c-1")
    _handle_all(billing, db_url, 5)
    replies = rows(
        db_url,
        "SELECT payload, causation_id, correlation_id FROM outbox_inbox.outbox_messages"
        " WHERE routing_key = 'billing.ledger.appended'",
    )
    assert sorted((r.payload["n"], r.causation_id, r.correlation_id) for r in replies) == [
        (n, ids[n], "c-1") for n in range(5)
    ]
    billing.close()


class _Recorded(Listener):
    def __init__(self) -> None:
        self.ran: list[tuple[str, float, BaseException | None]] = []
        self.done: list[str] = []

    def handler_ran(self, message: Message, seconds: float, error: BaseException | None) -> None:
        self.ran.append((str(message.message_id), seconds, error))

    def handled(self, message: Message) -> None:
        self.done.append(str(message.message_id))


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "one-fails"])
def test_the_listener_hears_of_each_message_of_a_batch(
    db_url: str, mq_url: str, fails: bool
) -> None:
    recorded = _Recorded()
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)
    billing.listener = recorded

    @billing.on_command("ledger.append", batch=True)
    def append(messages: list[Message], session: Session) -> None:
        if fails and any(m.payload["n"] == 3 for m in messages):
            raise RuntimeError("n = 3 fails")
        _write(session, messages)

    ids = _fill_inbox(billing, db_url, [{"n": n} for n in range(10)])
    with running(billing.worker()):
        wait_until(lambda: len(recorded.done) >= (9 if fails else 10), what="handled")
    expected = [i for n, i in enumerate(ids) if not (fails and n == 3)]
    assert sorted(recorded.done) == sorted(expected)
    succeeded = sorted(m for m, _, error in recorded.ran if error is None)
    assert succeeded == sorted(expected)
    assert all(seconds >= 0 for _, seconds, _ in recorded.ran)
    if fails:  # the failing message alone, with its error
        errors = [(m, str(e)) for m, _, e in recorded.ran if e is not None]
        assert errors == [(ids[3], "n = 3 fails")]
    billing.close()


def test_a_batch_handler_and_a_per_message_handler_of_one_event_run_in_one_savepoint(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)

    @billing.on_event("billing.ledger.*", batch=True)
    def many(messages: list[Message], session: Session) -> None:
        _write(session, messages, "batch")

    @billing.on_event("billing.ledger.appended")
    def one(message: Message, session: Session) -> None:
        if message.payload["n"] == 2:
            raise Reject("n = 2 is bad")
        session.execute(
            text("INSERT INTO effects (message_id, type, info) VALUES (:m, 'one', '\"one\"')"),
            {"m": f"one-{message.message_id}"},
        )

    billing.declare_topology()
    with billing.session() as session, session.begin():
        ids = [str(billing.outbox.publish(session, "ledger.appended", {"n": n})) for n in range(5)]
    with running(billing.relay(), billing.receiver()):
        wait_until(lambda: scalar(db_url, f"SELECT count(*) FROM {INBOX}") == 5, what="inbox")
    _handle_all(billing, db_url, 5)

    states = _states(db_url)
    assert states[ids[2]] == ("dead", 1, 1, "rejected")
    # The rejected message's batch effect was rolled back with its own handler's failure.
    assert _effects(db_url) == sorted(
        [i for n, i in enumerate(ids) if n != 2] + [f"one-{i}" for n, i in enumerate(ids) if n != 2]
    )
    billing.close()


EFFECTS = Table(
    "effects",
    MetaData(),
    Column("message_id", String, primary_key=True),
    Column("type", String),
    Column("info", String),
)
INSERT_EFFECT = insert(EFFECTS)


def test_deferred_writes_of_a_batch_run_as_one_statement_and_go_with_a_failing_message(
    db_url: str, mq_url: str
) -> None:
    """`ctx.write` in a per-message handler: the batch's writes run at its end as one
    executemany (one multi-row INSERT); after a failure each message's writes run at the end
    of its own savepoint, and the failing message's are dropped."""
    billing = make_service("billing", db_url, mq_url, worker_batch_size=50)
    inserts: list[int] = []

    @event.listens_for(billing.engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("INSERT INTO effects"):
            inserts.append(1)

    @billing.on_command("ledger.append")
    def append(ctx: HandlerContext) -> None:
        ctx.write(INSERT_EFFECT, {"message_id": str(ctx.message.message_id), "type": "w"})
        if ctx.payload.get("bad") and ctx.message.attempt == 1:
            raise RuntimeError("bad on its first attempt")

    ids = _fill_inbox(billing, db_url, [{"n": n} for n in range(50)])
    _handle_all(billing, db_url, 50)
    assert _effects(db_url) == sorted(ids)
    assert len(inserts) == 1  # 50 writes, one statement
    assert set(_states(db_url).values()) == {("processed", 1, 1, None)}

    inserts.clear()
    payloads: list[dict[str, Any]] = [{"n": n} for n in range(50, 60)]
    payloads[3]["bad"] = True
    more = _fill_inbox(billing, db_url, payloads)
    _handle_all(billing, db_url, 60)
    assert _effects(db_url) == sorted(ids + more)
    states = _states(db_url)
    assert states[more[3]] == ("processed", 2, 2, None)  # failed once, alone
    # The batch failed in a handler, before its writes ran: one statement per message alone
    # (the 9 others), then the retry's.
    assert len(inserts) == 9 + 1
    billing.close()
