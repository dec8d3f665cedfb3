"""`outbox-inbox dead-letters groups`, and --group / --parked on list, replay, purge and park:
a whole cause replayed or set aside in one audited command."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cli_app
from cli_support import Cli
from sqlalchemy import text

from helpers import inbox_message_ids, wait_until
from outbox_inbox import Service

INVOICE = "billing.invoice.create"
APP = ("--app", "cli_app:billing")


def _json(result: Any) -> Any:
    assert result.returncode == 0, result
    return json.loads(result.stdout)


def test_a_group_is_listed_parked_listed_as_parked_and_replayed_from_the_command_line(
    cli: Cli, make_service: Callable[..., Service], db_url: str, tmp_path: Path
) -> None:
    service = make_service()
    cli_app.set_types(service, "failing", INVOICE)
    service.start()
    with service.session() as session, session.begin():
        for n in range(4):
            service.outbox.send(session, "billing", "invoice.create", {"n": n})
    wait_until(lambda: len(inbox_message_ids(db_url, "dead")) == 4, what="four dead rows")
    with service.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_inbox.inbox_messages (message_id, kind, routing_key, payload,"
                " headers, status, dead_reason, fingerprint, processed_at)"
                " SELECT gen_random_uuid(), 'event', 'orders.order.placed', '{}', '{}', 'dead',"
                " 'expired', 'expired', now() FROM generate_series(1, 3)"
            )
        )

    shown = cli("dead-letters", "groups", *APP)
    assert shown.returncode == 0, shown
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:7] == ["ID", "COUNT", "TYPES", "SOURCES", "FIRST", "SEEN", "LAST"]
    assert lines[-1] == "2 groups, 7 dead letters"
    rejected, expired = _json(cli("dead-letters", "groups", *APP, "--json"))["groups"]
    assert rejected["fingerprint"].startswith("Reject at ")
    assert rejected["fingerprint"].endswith("cli_app.py:_record")
    assert (rejected["count"], rejected["types"], rejected["sources"]) == (4, [INVOICE], ["table"])
    assert (expired["count"], expired["fingerprint"]) == (3, "expired")
    assert lines[1].startswith(f"{rejected['id']}  4 ")

    park = ("dead-letters", "park", *APP, "--source", "all", "--group", rejected["id"])
    dry = cli(*park, "--dry-run")
    assert dry.returncode == 0, dry
    assert "selected 4 dead letters: table 4, outbox 0" in dry.stdout
    assert "dry run: nothing parked" in dry.stdout
    assert len(inbox_message_ids(db_url, "dead")) == 7
    parked = cli(*park)
    assert parked.returncode == 0, parked
    assert "table: parked 4 of 4" in parked.stdout
    assert inbox_message_ids(db_url, "parked") == inbox_message_ids(db_url, "parked", INVOICE)

    (left,) = _json(cli("dead-letters", "groups", *APP, "--json"))["groups"]
    assert left["fingerprint"] == "expired"
    (aside,) = _json(cli("dead-letters", "groups", *APP, "--parked", "--json"))["groups"]
    assert (aside["id"], aside["count"]) == (rejected["id"], 4)
    listed = _json(cli("dead-letters", "list", *APP, "--parked", "--json"))["dead_letters"]
    assert [d["type"] for d in listed] == [INVOICE] * 4
    assert {d["group"] for d in listed} == {rejected["id"]}
    everything = _json(cli("dead-letters", "list", *APP, "--source", "table", "--json"))
    assert {d["type"] for d in everything["dead_letters"]} == {"orders.order.placed"}
    on_queue = cli("dead-letters", "list", *APP, "--source", "queue", "--parked")
    assert on_queue.returncode != 0 and "only table and outbox" in on_queue.stderr

    cli_app.set_types(service, "failing")  # the bug is fixed: the parked group goes back
    replay = ("dead-letters", "replay", *APP, "--source", "all", "--parked", "--all")
    replayed = cli(*replay)
    assert replayed.returncode == 0, replayed
    assert "table: replayed 4 of 4" in replayed.stdout
    wait_until(
        lambda: len(inbox_message_ids(db_url, "processed", INVOICE)) == 4,
        what="the replayed group handled",
    )
    shown_again = _json(cli("dead-letters", "groups", *APP, "--parked", "--json"))
    assert shown_again["groups"] == []

    records = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    assert [(r["command"], r["count"], r["dry_run"], r["filters"]) for r in records] == [
        ("dead-letters park", 4, True, {"fingerprint": rejected["fingerprint"]}),
        ("dead-letters park", 4, False, {"fingerprint": rejected["fingerprint"]}),
        ("dead-letters replay", 4, False, {"parked": True}),
    ]
    service.stop()
