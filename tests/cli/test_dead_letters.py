"""`outbox-inbox dead-letters`: replayed dead letters are handled, purge removes what was listed."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import cli_app
import pika
from cli_support import Cli

from helpers import dead_rows_one_refused, inbox_message_ids, rows, scalar, wait_until
from outbox_inbox import Reject, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.dead_letters import DeadLetters, Filters
from outbox_inbox.messages import H_DEAD_QUEUE, H_DEAD_REASON, H_RECEIVE_ATTEMPT

INVOICE = "billing.invoice.create"
LEDGER = "billing.ledger.append"


def _set_failing(service: Service, *types: str) -> None:
    cli_app.set_types(service, "failing", *types)


def _send(service: Service, command: str, payloads: list[dict[str, Any]]) -> None:
    with service.session() as session, session.begin():
        for payload in payloads:
            service.outbox.send(session, "billing", command, payload)


def _dead(db_url: str, type_: str | None = None) -> list[str]:
    return inbox_message_ids(db_url, "dead", type_)


def _audit(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _publish(
    mq_url: str, exchange: str, routing_key: str, body: dict[str, Any], **props: Any
) -> None:
    """Publish as a plain AMQP client would (no `type` property unless given)."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            exchange,
            routing_key,
            json.dumps(body).encode(),
            pika.BasicProperties(content_type="application/json", delivery_mode=2, **props),
        )
    finally:
        connection.close()


def _depth(mq_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def _dead_letter_two_messages(service: Service, mq_url: str) -> None:
    """Put two messages without a `type` property into billing.dead_letter, the two ways
    they get there: forwarded by the receiver's own code (store_failed), and dead-lettered by
    RabbitMQ itself (a rejected delivery of billing.inbox, with an x-death record)."""
    _publish(mq_url, "commands", INVOICE, {"n": 1}, message_id="foreign-1")
    consumer = RabbitMQBroker(mq_url).consumer("billing.inbox", prefetch=10)
    try:
        (delivery,) = wait_until(lambda: consumer.fetch(1, 0.2), what="the command in the inbox")
        consumer.forward(
            delivery,
            "dead_letter",
            "billing",
            {
                H_DEAD_REASON: "store_failed: not stored after 12 attempts: database down",
                H_DEAD_QUEUE: "billing.inbox",
                H_RECEIVE_ATTEMPT: 12,
            },
        )
    finally:
        consumer.close()
    _publish(mq_url, "events", "orders.order.placed", {"n": 2}, message_id=str(uuid.uuid4()))
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        method = wait_until(
            lambda: channel.basic_get("billing.inbox")[0], what="the event in the inbox"
        )
        channel.basic_reject(method.delivery_tag, requeue=False)
    finally:
        connection.close()
    wait_until(lambda: _depth(mq_url, "billing.dead_letter") == 2, what="two dead letters")


def test_replayed_table_dead_letters_are_handled_in_order_at_the_rate_by_run_all_until_sigterm(
    cli: Cli,
    spawn: Callable[..., Any],
    make_service: Callable[..., Service],
    db_url: str,
    tmp_path: Path,
) -> None:
    service = make_service()
    _set_failing(service, INVOICE)
    runner = spawn("run", "all", "--app", "cli_app:billing")
    _send(service, "invoice.create", [{"n": n} for n in range(5)])
    _send(service, "ledger.append", [{"n": 99}])
    wait_until(lambda: len(_dead(db_url)) == 5, what="five dead rows")
    dead = _dead(db_url)

    listed = cli("dead-letters", "list", "--app", "cli_app:billing", "--source", "table")
    assert listed.returncode == 0, listed
    assert listed.stdout.count("rejected") == 5
    assert "5 dead letters: table 5" in listed.stdout

    _set_failing(service)  # the bug is fixed
    dry = cli(
        "dead-letters",
        "replay",
        "--app",
        "cli_app:billing",
        "--source",
        "table",
        "--type",
        "billing.invoice.*",
        "--dry-run",
    )
    assert dry.returncode == 0, dry
    assert _dead(db_url) == dead
    assert "audit" not in dry.stderr  # a dry run changes nothing: no audit warning

    replayed = cli(
        "dead-letters",
        "replay",
        "--app",
        "cli_app:billing",
        "--source",
        "table",
        "--type",
        "billing.invoice.*",
        "--rate",
        "10",
    )
    assert replayed.returncode == 0, replayed
    assert "table: replayed 5 of 5" in replayed.stdout

    handled = wait_until(
        lambda: (
            [
                r[0]
                for r in rows(
                    db_url, "SELECT message_id FROM effects WHERE type = :t ORDER BY seq", t=INVOICE
                )
            ]
            if scalar(db_url, "SELECT count(*) FROM effects WHERE type = :t", t=INVOICE) == 5
            else None
        ),
        what="the five replayed commands handled",
    )
    assert handled == dead  # handled in their original order
    assert _dead(db_url) == []
    spread = scalar(
        db_url,
        "SELECT extract(epoch FROM max(next_attempt_at) - min(next_attempt_at))"
        " FROM outbox_inbox.inbox_messages WHERE routing_key = :t",
        t=INVOICE,
    )
    assert spread >= 0.35  # 5 rows at 10 per second: at least 4 gaps of 0.1 s

    dry_line, line = _audit(tmp_path)
    assert dry_line["dry_run"] is True and dry_line["count"] == 5
    assert line["command"] == "dead-letters replay"
    assert line["source"] == "table"
    assert line["count"] == 5 and line["dry_run"] is False
    assert line["filters"] == {"type": ["billing.invoice.*"]}
    assert line["user"] and line["host"]
    assert sorted(line["message_ids"]) == sorted(dead)
    # The terminal gets one short line: what, how many, where the record is; not the ids.
    (logged,) = [line for line in replayed.stderr.splitlines() if "outbox_inbox.audit" in line]
    assert "WARNING" in logged and "dead-letters replay: 5 dead letters of billing" in logged
    assert logged.endswith(f"recorded in {tmp_path / 'audit.log'}")
    assert not any(message_id in replayed.stderr for message_id in dead)

    # `run all` stops gracefully: exit 0, nothing left leased.
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 0
    assert "Traceback" not in runner.stderr.read()
    assert (
        scalar(
            db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE locked_by IS NOT NULL"
        )
        == 0
    )


def test_replayed_broker_dead_letters_are_handled_by_the_service(
    cli: Cli, make_service: Callable[..., Service], db_url: str, mq_url: str, tmp_path: Path
) -> None:
    service = make_service()
    service.declare_topology()
    _dead_letter_two_messages(service, mq_url)

    listed = cli("dead-letters", "list", "--app", "cli_app:billing", "--source", "queue", "--json")
    assert listed.returncode == 0, listed
    letters = json.loads(listed.stdout)["dead_letters"]
    assert [(d["type"], d["reason"]) for d in letters] == [
        (INVOICE, "store_failed"),
        ("orders.order.placed", "rejected"),
    ]
    assert _depth(mq_url, "billing.dead_letter") == 2  # listing put them back
    # `list` and `count` name each source alike: as --source names it.
    summary = cli("dead-letters", "list", "--app", "cli_app:billing").stdout.splitlines()[-1]
    assert summary == "2 dead letters: table 0, outbox 0, queue 2, unroutable 0"
    counted = cli("dead-letters", "count", "--app", "cli_app:billing").stdout.splitlines()
    assert [line.split() for line in counted[1:]] == [
        ["table", "0"],
        ["outbox", "0"],
        ["queue", "2"],
        ["unroutable", "0"],
        ["2", "dead", "letters"],
    ]

    shown = cli("dead-letters", "show", "foreign-1", "--app", "cli_app:billing")
    assert shown.returncode == 0, shown
    assert "database down" in shown.stdout and '"n": 1' in shown.stdout

    service.start()
    replayed = cli(
        "dead-letters", "replay", "--app", "cli_app:billing", "--source", "queue", "--all"
    )
    assert replayed.returncode == 0, replayed
    assert "queue: replayed 2 of 2" in replayed.stdout
    wait_until(lambda: scalar(db_url, "SELECT count(*) FROM effects") == 2, what="both handled")
    types = {r[0] for r in rows(db_url, "SELECT type FROM effects")}
    assert types == {INVOICE, "orders.order.placed"}  # routing keys restored
    assert _depth(mq_url, "billing.dead_letter") == 0
    assert _audit(tmp_path)[-1]["counts"] == {"queue": 2}


def test_replaying_queue_dead_letters_first_sent_before_the_retention_warns_how_many(
    cli: Cli, make_service: Callable[..., Service], mq_url: str, tmp_path: Path
) -> None:
    service = make_service()
    service.declare_topology()
    now = datetime.now(UTC)
    ten_days_ago = int((now - timedelta(days=10)).timestamp())
    for n, sent in enumerate([ten_days_ago, ten_days_ago, int(now.timestamp())]):
        _publish(
            mq_url,
            "",
            "billing.dead_letter",
            {"n": n},
            message_id=str(uuid.uuid4()),
            type=INVOICE,
            timestamp=sent,
        )
    wait_until(lambda: _depth(mq_url, "billing.dead_letter") == 3, what="three dead letters")
    risk = (
        "first sent more than the retention (7 days) ago: a copy stored before may no longer "
        "be recognized and could be handled twice"
    )

    options = ("--app", "cli_app:billing", "--source", "queue", "--all")
    dry = cli("dead-letters", "replay", *options, "--dry-run", "--json")
    assert dry.returncode == 0, dry
    assert json.loads(dry.stdout)["warnings"] == [f"2 queue dead letters {risk}"]
    replayed = cli("dead-letters", "replay", *options)
    assert replayed.returncode == 0, replayed
    assert "queue: replayed 3 of 3" in replayed.stdout
    assert f"warning: 2 queue dead letters {risk}" in replayed.stderr

    # The library's result says it too; a letter sent within the retention does not.
    _publish(mq_url, "", "billing.dead_letter", {"n": 3}, message_id="old", timestamp=ten_days_ago)
    wait_until(lambda: _depth(mq_url, "billing.dead_letter") == 1, what="one more dead letter")
    report = DeadLetters.of(service).replay(["queue"], Filters(), audit_log=tmp_path / "a.log")
    assert report.done == ["old"]
    assert report.warnings == [f"1 queue dead letter {risk}"]
    assert report.as_dict()["warnings"] == report.warnings
    _publish(
        mq_url, "", "billing.dead_letter", {"n": 4}, message_id="within", timestamp=ten_days_ago
    )
    wait_until(lambda: _depth(mq_url, "billing.dead_letter") == 1, what="one more dead letter")
    longer = DeadLetters.of(service)
    longer.retention = timedelta(days=11)
    assert longer.replay(["queue"], Filters(), audit_log=tmp_path / "a.log").warnings == []


def test_replayed_unroutable_command_reaches_the_service_once_it_has_a_queue(
    cli: Cli, make_service: Callable[..., Service], db_url: str, mq_url: str
) -> None:
    make_service().declare_topology()  # billing's topology gives `commands` its alternate
    message_id = str(uuid.uuid4())
    _publish(
        mq_url,
        "commands",
        "shipping.parcel.ship",
        {"parcel": 7},
        message_id=message_id,
        type="shipping.parcel.ship",
    )
    wait_until(lambda: _depth(mq_url, "unroutable") == 1, what="the command kept in unroutable")
    replay = ["dead-letters", "replay", "--source", "unroutable", "--all", "--mq-url", mq_url]

    still = cli(*replay)
    assert still.returncode == 4, still
    assert f"kept {message_id}: still unroutable" in still.stdout
    assert _depth(mq_url, "unroutable") == 1

    shipping = make_service("shipping", schema="shipping")
    shipping.start()
    done = cli(*replay)
    assert done.returncode == 0, done
    assert "unroutable: replayed 1 of 1" in done.stdout
    wait_until(
        lambda: scalar(db_url, "SELECT count(*) FROM effects WHERE message_id = :m", m=message_id),
        what="the shipping service handling the command",
    )
    assert _depth(mq_url, "unroutable") == 0


def test_purge_removes_exactly_what_was_listed(
    cli: Cli, make_service: Callable[..., Service], db_url: str, mq_url: str, tmp_path: Path
) -> None:
    service = make_service()
    _set_failing(service, INVOICE, LEDGER)
    service.start()
    _send(service, "invoice.create", [{"n": n} for n in range(60)])
    _send(service, "ledger.append", [{"n": n} for n in range(3)])
    wait_until(lambda: len(_dead(db_url)) == 63, what="63 dead rows")
    service.stop()
    ledger_rows = _dead(db_url, LEDGER)
    _dead_letter_two_messages(service, mq_url)

    def counted(*args: str) -> dict[str, int]:
        result = cli("dead-letters", "count", "--app", "cli_app:billing", *args, "--json")
        assert result.returncode == 0, result
        counts: dict[str, int] = json.loads(result.stdout)["counts"]
        return counts

    assert counted() == {"table": 63, "outbox": 0, "queue": 2, "unroutable": 0}
    assert counted("--source", "table", "--type", INVOICE) == {"table": 60}
    assert counted("--source", "table", "--type", "billing.ledger.*") == {"table": 3}
    assert counted("--source", "queue", "--reason", "store_failed") == {"queue": 1}
    assert _depth(mq_url, "billing.dead_letter") == 2  # counting read them and gave them back

    selection = ["--app", "cli_app:billing", "--source", "table", "--type", INVOICE]
    listed = cli("dead-letters", "list", *selection, "--json")
    assert listed.returncode == 0, listed
    listed_ids = [d["message_id"] for d in json.loads(listed.stdout)["dead_letters"]]
    assert listed_ids == _dead(db_url, INVOICE) and len(listed_ids) == 60

    declined = cli("dead-letters", "purge", *selection, input="n\n")
    assert declined.returncode == 1, declined
    assert "Purge 60 dead letters (table 60)?" in declined.stderr
    dry = cli("dead-letters", "purge", *selection, "--dry-run")
    assert dry.returncode == 0, dry
    assert len(_dead(db_url)) == 63

    purged = cli("dead-letters", "purge", *selection, input="y\n")
    assert purged.returncode == 0, purged
    assert "table: purged 60 of 60" in purged.stdout
    assert "purge 60" in purged.stderr  # the progress bar's label
    assert _dead(db_url) == ledger_rows  # exactly the listed rows are gone
    assert (
        scalar(
            db_url,
            "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE message_id::text = ANY(:ids)",
            ids=listed_ids,
        )
        == 0
    )

    queue_listed = cli(
        "dead-letters",
        "list",
        "--app",
        "cli_app:billing",
        "--source",
        "queue",
        "--reason",
        "rejected",
        "--json",
    )
    (letter,) = json.loads(queue_listed.stdout)["dead_letters"]
    queue_purged = cli(
        "dead-letters",
        "purge",
        "--app",
        "cli_app:billing",
        "--source",
        "queue",
        "--reason",
        "rejected",
        "--yes",
        "--json",
    )
    assert queue_purged.returncode == 0, queue_purged
    (result,) = json.loads(queue_purged.stdout)["results"]
    assert result["message_ids"] == [letter["message_id"]]
    left = cli("dead-letters", "list", "--app", "cli_app:billing", "--source", "queue", "--json")
    assert [d["reason"] for d in json.loads(left.stdout)["dead_letters"]] == ["store_failed"]

    audit = _audit(tmp_path)
    assert [(a["command"], a["source"], a["count"], a["dry_run"]) for a in audit] == [
        ("dead-letters purge", "table", 60, True),
        ("dead-letters purge", "table", 60, False),
        ("dead-letters purge", "queue", 1, False),
    ]


def test_a_dead_letter_with_a_header_pika_cannot_decode_is_listed_and_replayed(
    cli: Cli, make_service: Callable[..., Service], db_url: str, mq_url: str
) -> None:
    """A header timestamp past the year 9999 broke the operator's connection (pika's own
    decoding); the tools read and republish it as the receiver does, unchanged."""
    import amqp_raw

    service = make_service()
    service.declare_topology()
    headers = amqp_raw.table_body(
        [
            ("far", amqp_raw.timestamp(2**64 - 1)),
            (H_DEAD_REASON, amqp_raw.long_string("invalid: a test")),
            (H_DEAD_QUEUE, amqp_raw.long_string("billing.inbox")),
            ("x-original-exchange", amqp_raw.long_string("commands")),
            ("x-original-routing-key", amqp_raw.long_string(INVOICE)),
        ]
    )
    publisher = amqp_raw.RawPublisher(mq_url)
    try:
        assert publisher.publish(
            "dead_letter",
            "billing",
            json.dumps({"n": 7}).encode(),
            {"message_id": "far-1", "content_type": "application/json", "headers": headers},
        )
    finally:
        publisher.close()
    wait_until(lambda: _depth(mq_url, "billing.dead_letter") == 1, what="the dead letter")

    listed = cli("dead-letters", "list", "--app", "cli_app:billing", "--source", "queue", "--json")
    assert listed.returncode == 0, listed
    assert [d["message_id"] for d in json.loads(listed.stdout)["dead_letters"]] == ["far-1"]

    service.start()
    replayed = cli(
        "dead-letters", "replay", "--app", "cli_app:billing", "--source", "queue", "--all"
    )
    assert replayed.returncode == 0, replayed
    wait_until(lambda: scalar(db_url, "SELECT count(*) FROM effects") == 1, what="handled")
    assert _depth(mq_url, "billing.dead_letter") == 0


def test_an_outbox_row_the_broker_refused_is_listed_shown_and_replayed_once_the_limit_allows(
    cli: Cli,
    make_service: Callable[..., Service],
    db_url: str,
    mq_url: str,
    local_rabbitmq_server: Any,
    rabbitmq_body_limit: Callable[[int], None],
    tmp_path: Path,
) -> None:
    rabbitmq_body_limit(64 * 1024)
    service = make_service(relay_max_attempts=1)
    service.start()
    big = {"blob": "x" * (80 * 1024)}
    with service.session() as session, session.begin():
        big_id = service.outbox.send(session, "billing", "invoice.create", big)
        small_id = service.outbox.send(session, "billing", "invoice.create", {"n": 1})
    effects = "SELECT count(*) FROM effects WHERE message_id = :m"
    wait_until(lambda: scalar(db_url, effects, m=str(small_id)), what="the small command handled")
    outbox_dead = "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE dead_at IS NOT NULL"
    wait_until(lambda: scalar(db_url, outbox_dead) == 1, what="the big command dead")

    listed = cli("dead-letters", "list", "--app", "cli_app:billing", "--source", "outbox", "--json")
    assert listed.returncode == 0, listed
    [letter] = json.loads(listed.stdout)["dead_letters"]
    assert letter["message_id"] == str(big_id)
    assert letter["source"] == "outbox" and letter["reason"] == "refused"
    assert "max size 65536" in letter["error"]
    shown = cli("dead-letters", "show", str(big_id), "--app", "cli_app:billing")
    assert shown.returncode == 0, shown
    assert "outbox (row " in shown.stdout and "refused by the broker: 406" in shown.stdout
    status = cli("status", "--app", "cli_app:billing", "--max-dead", "0")
    assert status.returncode == 4, status
    assert "dead 1" in status.stdout

    # The operator raises the limit; the broker's restart drops every connection, and the
    # relay asks for the limit again when it reconnects.
    rabbitmq_body_limit(1024 * 1024)
    vhost = unquote(urlsplit(mq_url).path[1:])
    local_rabbitmq_server.rabbitmqctl("close_all_connections", "-p", vhost, "limit raised")
    replayed = cli(
        "dead-letters", "replay", "--app", "cli_app:billing", "--source", "outbox",
        "--id", str(big_id),
    )  # fmt: skip
    assert replayed.returncode == 0, replayed
    assert "outbox: replayed 1 of 1" in replayed.stdout
    wait_until(
        lambda: scalar(db_url, effects, m=str(big_id)), timeout=30, what="the replayed command"
    )
    assert scalar(db_url, outbox_dead) == 0
    assert [e["command"] for e in _audit(tmp_path)] == ["dead-letters replay"]
    service.stop()


def test_dead_letters_of_a_sqlite_service_are_listed_and_counted_without_a_broker(
    cli: Cli, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'billing.db'}"
    service = Service("billing", db_url=db, broker=MemoryBroker(), worker_poll_interval=0.05)

    @service.on_command("invoice.create")
    def refuse(message: Any, session: Any) -> None:
        raise Reject("no invoices today")

    service.migrate()
    service.start()
    try:
        with service.session() as session, session.begin():
            service.outbox.send(session, "billing", "invoice.create", {"n": 1})
        wait_until(lambda: scalar(db, "SELECT count(*) FROM inbox_messages WHERE status = 'dead'"))
    finally:
        service.stop()
        service.close()
    target = ["--db-url", db, "--service", "billing", "--source", "table"]
    listed = cli("dead-letters", "list", *target)
    assert listed.returncode == 0, listed
    assert "rejected" in listed.stdout and "1 dead letter: table 1" in listed.stdout
    counted = cli("dead-letters", "count", *target, "--reason", "rejected", "--json")
    assert counted.returncode == 0, counted
    assert json.loads(counted.stdout)["counts"] == {"table": 1}


def test_a_replay_that_fails_half_way_says_what_it_did_and_its_audit_line_lists_it(
    cli: Cli, make_service: Callable[..., Service], db_url: str, tmp_path: Path
) -> None:
    """A trigger refuses the 25th of 50 dead rows, replayed 10 a transaction: the command
    exits with the error, says on stderr that it replayed 20 of 50 before it, and its audit
    line lists exactly those 20."""
    ids = dead_rows_one_refused(make_service(), 50, refused=25)
    replay = "dead-letters replay --app cli_app:billing --source table --all --rate 100"
    result = cli(*replay.split(), "--audit-log", str(tmp_path / "audit.log"))
    assert result.returncode != 0, result
    assert "this row is refused" in result.stderr, result
    assert "table: replayed 20 of 50 before the error" in result.stderr, result
    (line,) = _audit(tmp_path)
    assert line["message_ids"] == ids[:20] and "this row is refused" in line["error"]
    assert _dead(db_url) == ids[20:]
