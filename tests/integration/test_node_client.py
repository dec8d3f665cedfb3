"""A service that is not Python: Node.js with amqplib, by the rules of docs/wire-format.md.

The worked example of docs/wire-format.md is taken from the page as it is and run with node
against a running service: it sends a command and an event and matches each answer to what it
sent by ``x-causation-id``. A second script sends what amqplib makes of JavaScript values that
pika cannot decode (doubles, a timestamp in milliseconds in a header).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from helpers import make_service, rows, wait_until
from outbox_inbox import Message, Service

ROOT = Path(__file__).resolve().parents[2]
WIRE_FORMAT = ROOT / "docs" / "wire-format.md"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="needs Node.js and npm (node and npm not found on PATH)",
)


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with amqplib installed from npm, where the scripts run."""
    directory = tmp_path_factory.mktemp("node")
    (directory / "package.json").write_text('{"name": "wire-format-check", "private": true}\n')
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "amqplib@2"],
        cwd=directory,
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=300,
    )
    return directory


def example_from_docs() -> str:
    """The JavaScript of the worked example in docs/wire-format.md."""
    text = WIRE_FORMAT.read_text(encoding="utf-8")
    section = text.split("## A worked example in Node.js (amqplib)", 1)[1]
    match = re.search(r"```js\n(.*?)```", section, re.DOTALL)
    assert match, "docs/wire-format.md has no ```js block in its worked example"
    return match.group(1)


def run_node(directory: Path, name: str, script: str, mq_url: str) -> dict[str, Any]:
    path = directory / name
    path.write_text(script, encoding="utf-8")
    result = subprocess.run(
        ["node", str(path)],
        cwd=directory,
        env={**os.environ, "AMQP_URL": mq_url},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    output: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return output


@pytest.fixture
def billing(db_url: str, mq_url: str) -> Iterator[Service]:
    service = make_service("billing", db_url, mq_url)

    @service.on_command("quote.request")
    def quote(message: Message, session: Any) -> None:
        price = message.payload["quantity"] * 10
        service.outbox.publish(
            session, "quote.given", {"sku": message.payload["sku"], "price": price}
        )

    @service.on_event("shop.order.placed")
    def order_placed(message: Message, session: Any) -> None:
        service.outbox.send(session, "shop", "invoice.ready", {"order": message.payload["order"]})

    @service.on_command("note.take")
    def note(message: Message, session: Any) -> None:
        pass

    service.start()
    try:
        yield service
    finally:
        service.stop()
        service.close()


def test_the_worked_example_of_the_wire_format_runs_against_a_live_service(
    billing: Service, node_dir: Path, mq_url: str, db_url: str
) -> None:
    started = datetime.now(UTC)
    answers = run_node(node_dir, "shop-client.mjs", example_from_docs(), mq_url)

    [(quote_id, headers, key, source, created_at, status)] = rows(
        db_url,
        "SELECT headers->>'x-original-message-id', headers, key, source, created_at, status"
        " FROM outbox_inbox.inbox_messages WHERE routing_key = 'billing.quote.request'",
    )
    assert quote_id.startswith("quote-")
    assert answers["quote"] == {
        "routingKey": "billing.quote.given",
        "correlationId": quote_id,  # the command sent none: its own id
        "body": {"sku": "A-1", "price": 30},
    }
    assert answers["invoice"] == {
        "routingKey": "shop.invoice.ready",
        "correlationId": "checkout-7",
        "body": {"order": 7},
    }
    assert headers["x-amqp-type"] == "RequestQuote"
    assert headers["tenant"] == "acme"
    assert (key, source, status) == ("sku-A-1", "shop", "processed")
    assert abs((created_at - started).total_seconds()) < 60  # Date.now() is in milliseconds
    [(payload, kind)] = rows(
        db_url,
        "SELECT payload, kind FROM outbox_inbox.inbox_messages"
        " WHERE routing_key = 'shop.order.placed'",
    )
    assert (payload, kind) == ({"order": 7, "total": 59.9}, "event")


NODE_VALUES = """
import amqp from "amqplib";

const connection = await amqp.connect(process.env.AMQP_URL);
const channel = await connection.createConfirmChannel();
const now = Date.now();
channel.publish("commands", "billing.note.take", Buffer.from('{"text": "hi"}'), {
  messageId: "note-1",
  contentType: "application/json; charset=utf-8",
  persistent: true,
  mandatory: true,
  timestamp: now,
  headers: {
    price: 12.75,                                  // a double
    sentAt: { "!": "timestamp", value: now },      // a timestamp in milliseconds
    big: 2 ** 40,                                  // a 64-bit integer
    nested: { list: [1, "two", null, true] },
  },
});
await channel.waitForConfirms();
console.log(JSON.stringify({ now }));
await connection.close();
"""


def test_what_amqplib_makes_of_javascript_values_is_stored(
    billing: Service, node_dir: Path, mq_url: str, db_url: str
) -> None:
    sent = run_node(node_dir, "values.mjs", NODE_VALUES, mq_url)

    def stored() -> list[Any]:
        return rows(
            db_url,
            "SELECT headers, created_at, status FROM outbox_inbox.inbox_messages"
            " WHERE routing_key = 'billing.note.take' AND status = 'processed'",
        )

    [(headers, created_at, _status)] = wait_until(stored, timeout=20, what="the note handled")
    assert headers["price"] == 12.75
    assert headers["sentAt"] == str(sent["now"])
    assert headers["big"] == 2**40
    assert headers["nested"] == {"list": [1, "two", None, True]}
    assert int(created_at.timestamp() * 1000) == sent["now"]
