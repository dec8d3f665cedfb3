"""The contract of `outbox_inbox.testing` itself, on a small service built in each test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox_inbox import ConfigurationError, Message, Retry, RetryPolicy, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.testing import HarnessTimeout, NotDelivered, ServiceHarness

HarnessFactory = Callable[..., ServiceHarness]


def build_demo(db_url: str, broker: MemoryBroker) -> Service:
    return Service("demo", db_url=db_url, broker=broker, retry=RetryPolicy(max_attempts=3))


def test_deliver_refuses_a_command_for_another_service_and_an_event_nobody_handles(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)

    with pytest.raises(NotDelivered, match="addressed to another service"):
        demo.deliver("billing.invoice.create", {})
    with pytest.raises(NotDelivered, match="subscribes to no event"):
        demo.deliver("orders.order.placed", {}, kind="event")
    assert demo.inbox_rows() == []


def test_a_command_without_handler_is_stored_and_dead_as_no_handler(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)

    row = demo.handle("demo.thing.do", {"n": 1})

    assert (row.status, row.dead_reason, row.payload) == ("dead", "no_handler", {"n": 1})


def test_without_skip_delays_a_failed_message_waits_for_its_retry(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)
    calls: list[int] = []

    @demo.service.on_command("job.run")
    def run(message: Message, session: Session) -> None:
        calls.append(message.attempt)
        if len(calls) < 2:
            raise Retry(delay=60)

    message_id = demo.deliver("demo.job.run", {})
    assert demo.run_until_idle(skip_delays=False) == 1
    assert demo.inbox_row(message_id).status == "pending"  # due in 60 s

    assert demo.run_until_idle() == 1  # the wait is skipped
    assert demo.inbox_row(message_id).status == "processed"
    assert calls == [1, 2]


def test_skip_delays_makes_an_outbox_message_written_with_a_delay_leave_now(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)
    with demo.service.session() as session, session.begin():
        demo.service.outbox.publish(session, "job.scheduled", {"n": 1}, delay=3600)

    assert demo.relay() == 0  # due in an hour
    assert demo.skip_delays() == 1
    assert demo.relay() == 1
    assert [m.sent for m in demo.published("demo.job.scheduled")] == [True]


def test_handlers_registered_after_the_harness_receive_their_events(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)
    seen: list[Any] = []

    @demo.service.on_event("demo.ping.*")
    def on_ping(message: Message, session: Session) -> None:
        seen.append(message.payload)
        if message.type == "demo.ping.sent":
            demo.service.outbox.publish(session, "ping.answered", {"to": message.payload})

    demo.deliver("demo.ping.sent", 1, kind="event")
    demo.run_until_idle()

    assert seen == [1, {"to": 1}]  # its own event came back through the broker
    [answer] = demo.published("demo.ping.#")
    assert answer.type == "demo.ping.answered" and answer.sent


def test_run_until_idle_gives_up_on_handlers_that_never_stop_producing_work(
    outbox_inbox_harness: HarnessFactory,
) -> None:
    demo = outbox_inbox_harness(build_demo)

    @demo.service.on_command("loop.again")
    def again(message: Message, session: Session) -> None:
        demo.service.outbox.send(session, "demo", "loop.again", {})

    demo.deliver("demo.loop.again", {})
    with pytest.raises(HarnessTimeout, match=r"not idle after 0\.5 s: demo: inbox"):
        demo.run_until_idle(timeout=0.5)


def test_a_service_on_the_process_shared_in_memory_broker_is_refused(tmp_path: Any) -> None:
    service = Service("demo", db_url=f"sqlite:///{tmp_path / 'x.db'}")  # mq_url=None
    with pytest.raises(ConfigurationError, match="shared in-memory broker"):
        ServiceHarness(service, migrate=False)
