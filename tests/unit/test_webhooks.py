"""Webhooks out without servers: the Standard Webhooks signature against the specification's
example, the settings' checks, and which events get a delivery row."""

from __future__ import annotations

import uuid

import pytest

from outbox_inbox.config import Settings
from outbox_inbox.errors import ConfigurationError
from outbox_inbox.outbox import delivery_rows
from outbox_inbox.webhooks import Webhook, signature

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_the_signature_is_the_specifications_example() -> None:
    """The example of the Standard Webhooks reference libraries; two secrets sign twice."""
    args = ("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    one = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert signature((SECRET,), *args) == one
    assert signature((SECRET, SECRET), *args) == f"{one} {one}"


@pytest.mark.parametrize(
    "options",
    [
        {"name": "Bad Name"},
        {"url": "ftp://example.com/"},
        {"patterns": ()},
        {"secrets": ()},
        {"secrets": ("not-a-secret",)},
        {"secrets": ("whsec_***",)},
        {"max_in_flight": 0},
    ],
)
def test_a_webhook_is_checked(options: dict[str, object]) -> None:
    values = {"name": "crm", "url": "https://x.test/h", "patterns": "orders.#", "secrets": SECRET}
    with pytest.raises(ConfigurationError):
        Webhook(**{**values, **options})  # type: ignore[arg-type]


def test_settings_check_the_schedule_and_the_names() -> None:
    hook = Webhook(name="crm", url="https://x.test/h", patterns="orders.#", secrets=SECRET)
    assert Settings(webhooks=[hook]).webhooks == (hook,)
    assert "x.test" not in repr(hook) and SECRET not in repr(hook)
    with pytest.raises(ConfigurationError):
        Settings(webhooks=[hook, hook])
    with pytest.raises(ConfigurationError):
        Settings(webhook_schedule=(5, -1))


def test_each_matching_endpoint_gets_a_delivery_row() -> None:
    hooks = tuple(
        Webhook(name=n, url="https://x.test/h", patterns=p, secrets=SECRET)
        for n, p in (("all", "orders.#"), ("placed", "orders.*.placed"), ("none", "billing.#"))
    )
    event = {"message_id": uuid.uuid4(), "routing_key": "orders.order.placed", "key": "k"}
    made = delivery_rows(event, hooks)
    assert [r["exchange"] for r in made] == ["webhook:all", "webhook:placed"]
    assert {r["causation_id"] for r in made} == {str(event["message_id"])}
    assert len({r["message_id"] for r in made}) == 2 and all(r["key"] is None for r in made)


def test_a_payload_store_that_cannot_be_read_now_is_a_failed_attempt_and_no_request() -> None:
    """Not `payload_missing` (the payload may be back later): an answer without a status,
    which the role counts as a failed attempt, retried on the schedule; nothing is POSTed."""
    from datetime import UTC, datetime

    from outbox_inbox.webhooks import post

    class Unmounted:
        name = "files"

        def get(self, key: str) -> bytes:
            raise OSError("Transport endpoint is not connected")

    hook = Webhook(name="crm", url="http://192.0.2.1:9/", patterns=("orders.#",), secrets=SECRET)
    headers = {"x-payload-ref": f"files/{uuid.uuid4()}", "x-payload-size": 9}
    row = {"routing_key": "orders.order.placed", "created_at": datetime.now(UTC)}
    answer = post(hook, {**row, "payload": None, "headers": headers}, 0.1, (Unmounted(),))
    assert answer == "payload store: Transport endpoint is not connected"
