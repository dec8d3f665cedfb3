"""`outbox-inbox topology plan | apply | verify` against the real broker."""

from __future__ import annotations

import json
import re
from typing import Any

import pika
import pytest
from cli_support import Cli

#: Objects of `cli_app:billing` (default settings: seven delay tiers).
EXPECTED_COUNT = 5 + 3 + 7 + 5


def _channel_do(mq_url: str, *actions: Any) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        for action in actions:
            action(channel)
    finally:
        connection.close()


def _states(result_stdout: str) -> dict[str, str]:
    plan = json.loads(result_stdout)
    return {f"{i['kind']} {i['name']}": i["state"] for i in plan["items"]}


@pytest.fixture
def management(rabbitmq_server: Any) -> str:
    url = getattr(rabbitmq_server, "management_url", None)
    if not url:
        pytest.skip(f"{rabbitmq_server!r} has no management API the tests know of")
    return str(url)


def test_verify_fails_on_a_missing_binding_and_passes_after_apply(
    cli: Cli, mq_url: str, management: str
) -> None:
    empty = cli("topology", "plan", "--app", "cli_app:billing", "--json")
    assert empty.returncode == 0, empty
    states = _states(empty.stdout)
    assert len(states) == EXPECTED_COUNT
    assert set(states.values()) == {"missing"}
    assert "binding events -> billing.inbox (orders.order.*)" in states

    applied = cli("topology", "apply", "--app", "cli_app:billing")
    assert applied.returncode == 0, applied
    assert f"declared {EXPECTED_COUNT} missing objects" in applied.stdout

    assert cli("topology", "verify", "--app", "cli_app:billing").returncode == 0

    _channel_do(mq_url, lambda ch: ch.queue_unbind("billing.inbox", "events", "orders.order.*"))
    broken = cli("topology", "verify", "--app", "cli_app:billing")
    assert broken.returncode == 4, broken
    assert re.search(r"events -> billing\.inbox \(orders\.order\.\*\) +missing", broken.stdout)
    assert "verify failed" in broken.stderr

    again = cli("topology", "apply", "--app", "cli_app:billing")
    assert again.returncode == 0, again
    assert "declared 1 missing object; " in again.stdout
    verified = cli("topology", "verify", "--app", "cli_app:billing", "--json")
    assert verified.returncode == 0, verified
    assert set(_states(verified.stdout).values()) == {"present"}


def test_verify_reports_arguments_that_differ_and_extra_bindings(
    cli: Cli, mq_url: str, management: str
) -> None:
    _channel_do(
        mq_url,
        lambda ch: ch.exchange_declare("events", "topic", durable=True),
        lambda ch: ch.queue_declare("billing.inbox", durable=True),  # no DLX, no SAC
        lambda ch: ch.queue_bind("billing.inbox", "events", "stale.#"),
    )
    result = cli("topology", "verify", "--app", "cli_app:billing", "--json")
    assert result.returncode == 4, result
    plan = json.loads(result.stdout)
    items = {f"{i['kind']} {i['name']}": i for i in plan["items"]}
    assert items["queue billing.inbox"]["state"] == "differs"
    assert "x-single-active-consumer" in items["queue billing.inbox"]["detail"]
    assert items["binding events -> billing.inbox (stale.#)"]["state"] == "extra"
    assert items["exchange events"]["state"] == "present"

    refused = cli("topology", "apply", "--app", "cli_app:billing")
    assert refused.returncode == 1, refused
    assert "queue billing.inbox" in refused.stderr
    assert "nothing was declared" in refused.stderr


def test_apply_without_management_api_lists_and_counts_every_object_it_declared(
    cli: Cli, mq_url: str
) -> None:
    """The shared exchanges and `unroutable` are there once billing applied: shipping's
    binding unroutable -> unroutable cannot be checked without the API. It is declared all
    the same, so it is in the table and the count, which add up to every object."""
    no_api = {"OUTBOX_INBOX_MANAGEMENT_URL": "http://127.0.0.1:1"}
    assert cli("topology", "apply", "--app", "cli_app:billing", env=no_api).returncode == 0
    planned = cli("topology", "plan", "--app", "cli_app:shipping", "--json", env=no_api)
    states = _states(planned.stdout)
    assert states["binding unroutable -> unroutable (no key)"] == "unverified"
    declared = {name for name, state in states.items() if state in ("missing", "unverified")}

    applied = cli("topology", "apply", "--app", "cli_app:shipping", env=no_api)
    assert applied.returncode == 0, applied
    table = applied.stdout.splitlines()[2:-1]
    assert {" ".join(re.split(r" {2,}", line)[:2]) for line in table} == declared
    assert re.search(
        r"unroutable -> unroutable \(no key\) +declared \(unverified\)", applied.stdout
    )
    missing = sum(1 for state in states.values() if state == "missing")
    present = sum(1 for state in states.values() if state == "present")
    assert applied.stdout.splitlines()[-1] == (
        f"declared {missing} missing objects and 1 unverified binding; {present} were present"
    )
    assert missing + 1 + present == len(states)


def test_without_management_api_amqp_checks_queues_and_bindings_are_unverified(
    cli: Cli, mq_url: str
) -> None:
    no_api = {"OUTBOX_INBOX_MANAGEMENT_URL": "http://127.0.0.1:1"}
    assert cli("topology", "apply", "--app", "cli_app:billing").returncode == 0
    unverified = cli("topology", "verify", "--app", "cli_app:billing", env=no_api)
    assert unverified.returncode == 3, unverified
    assert "unverified" in unverified.stdout
    assert "management API" in unverified.stderr

    # Over AMQP alone a queue declared with other arguments is still caught (406 on redeclare).
    _channel_do(
        mq_url,
        lambda ch: ch.queue_delete("billing.dead_letter"),
        lambda ch: ch.queue_declare(
            "billing.dead_letter", durable=True, arguments={"x-max-length": 5}
        ),
        lambda ch: ch.queue_delete("billing.delay.5s"),
    )
    drift = cli("topology", "verify", "--app", "cli_app:billing", "--json", env=no_api)
    assert drift.returncode == 4, drift
    states = _states(drift.stdout)
    assert states["queue billing.dead_letter"] == "differs"
    assert states["queue billing.delay.5s"] == "missing"
    assert states["queue billing.inbox"] == "present"
    assert states["binding commands -> billing.inbox (billing.#)"] == "unverified"
    assert states["binding dead_letter -> billing.dead_letter (billing)"] == "unverified"
