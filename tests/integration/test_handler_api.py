"""The handler API: a context with bound publish/send, and typed payloads decoded before the
handler runs (an invalid one is dead at once, its batch-mates handled)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from helpers import make_service, rows, wait_until
from outbox_inbox import ConfigurationError, HandlerContext, MemoryBroker, Message, Service

INBOX = "outbox_inbox.inbox_messages"


@dataclass
class Line:
    sku: str
    quantity: int


@dataclass
class CreateInvoice:
    order_id: int
    amount_cents: int
    lines: list[Line]
    note: str | None = None


class Refund(pydantic.BaseModel):
    order_id: int
    amount_cents: pydantic.PositiveInt


def _effect(session: Session, message: Message, info: Any) -> None:
    session.execute(
        text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
        {"m": str(message.message_id), "t": message.type, "i": json.dumps(info)},
    )


def test_typed_payloads_reach_the_handler_as_their_type_and_an_invalid_one_is_dead_at_once(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url, worker_batch_size=10)

    @billing.on_command("invoice.create")
    def create(message: Message, session: Session, payload: CreateInvoice) -> None:
        assert isinstance(payload, CreateInvoice) and isinstance(payload.lines[0], Line)
        _effect(session, message, [payload.order_id, payload.lines[0].quantity, payload.note])

    @billing.on_command("invoice.refund")
    def refund(message: Message, session: Session, payload: Refund) -> None:
        _effect(session, message, [payload.order_id, payload.amount_cents])

    good = {"order_id": 7, "amount_cents": 4200, "lines": [{"sku": "a", "quantity": 2}]}
    missing = {"order_id": 8, "lines": []}  # amount_cents is required
    wrong = {"order_id": 9, "amount_cents": "lots", "lines": []}
    with billing.session() as session, session.begin():
        ids = {
            name: billing.outbox.send(session, "billing", command, payload)
            for name, command, payload in [
                ("good", "invoice.create", good),
                ("missing", "invoice.create", missing),
                ("wrong", "invoice.create", wrong),
                ("refund", "invoice.refund", {"order_id": 7, "amount_cents": 100}),
                ("bad_refund", "invoice.refund", {"order_id": 7, "amount_cents": -5}),
                # publish/send take the same types: sent as its fields
                ("typed", "invoice.create", CreateInvoice(10, 1, [Line("b", 3)], "x")),
            ]
        }
    billing.start()
    try:
        # (billing sends to itself: the faults of its dead commands come back; not counted.)
        settled = (
            f"SELECT count(*) FROM {INBOX} WHERE status IN ('processed', 'dead')"
            " AND routing_key NOT LIKE 'billing.fault.%'"
        )
        wait_until(lambda: rows(db_url, settled)[0][0] == len(ids), what="every row settled")
    finally:
        billing.stop()
    state = {
        str(r.message_id): r
        for r in rows(
            db_url, f"SELECT message_id, status, attempts, dead_reason, last_error FROM {INBOX}"
        )
    }
    effects = {r.message_id: json.loads(r.info) for r in rows(db_url, "SELECT * FROM effects")}
    assert effects == {
        str(ids["good"]): [7, 2, None],
        str(ids["refund"]): [7, 100],
        str(ids["typed"]): [10, 3, "x"],
    }
    for name, field in (("missing", "amount_cents"), ("wrong", "amount_cents")):
        row = state[str(ids[name])]
        assert (row.status, row.attempts, row.dead_reason) == ("dead", 1, "invalid_payload")
        assert f"payload.{field}" in row.last_error
    bad = state[str(ids["bad_refund"])]
    assert (bad.status, bad.attempts, bad.dead_reason) == ("dead", 1, "invalid_payload")
    assert "amount_cents" in bad.last_error and "greater than 0" in bad.last_error
    billing.close()


def test_a_context_handler_publishes_and_sends_in_its_transaction_with_the_messages_ids(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url)

    @billing.on_command("invoice.create")
    def create(ctx: HandlerContext, payload: CreateInvoice) -> None:
        _effect(ctx.session, ctx.message, payload.order_id)
        ctx.publish("invoice.created", {"order_id": payload.order_id})
        ctx.send(to="shipping", command="parcel.ship", payload={"order_id": payload.order_id})

    with billing.session() as session, session.begin():
        command = billing.outbox.send(
            session,
            "billing",
            "invoice.create",
            {"order_id": 5, "amount_cents": 1, "lines": []},
            correlation_id="conversation-5",
        )
    billing.start()
    try:
        wait_until(lambda: rows(db_url, "SELECT count(*) FROM effects")[0][0] == 1)
        sent = f"SELECT count(*) FROM outbox_inbox.outbox_messages WHERE causation_id = '{command}'"
        wait_until(lambda: rows(db_url, sent)[0][0] == 2, what="the two messages of the handler")
    finally:
        billing.stop()
    written = rows(
        db_url,
        "SELECT routing_key, correlation_id FROM outbox_inbox.outbox_messages"
        " WHERE causation_id = :c ORDER BY id",
        c=str(command),
    )
    assert [(r.routing_key, r.correlation_id) for r in written] == [
        ("billing.invoice.created", "conversation-5"),
        ("shipping.parcel.ship", "conversation-5"),
    ]
    billing.close()


def test_a_payload_annotated_with_a_type_that_cannot_be_decoded_is_refused_at_registration(
    tmp_path: Any,
) -> None:
    service = Service("billing", db_url=f"sqlite:///{tmp_path / 'x.db'}", broker=MemoryBroker())
    with pytest.raises(ConfigurationError, match="dataclass or a pydantic model"):

        @service.on_command("invoice.create")
        def create(message: Message, session: Session, payload: int) -> None: ...

    service.close()
