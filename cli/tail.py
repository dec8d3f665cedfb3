"""`outbox-inbox tail PATTERN`: print matching messages live, through a throwaway queue."""

from __future__ import annotations

import json
import signal
import threading
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import click

from outbox_inbox.dead_letters import Filters
from outbox_inbox.messages import COMMANDS_EXCHANGE, EVENTS_EXCHANGE, WireMessage
from outbox_inbox.topology import topic_matches

from .output import echo, one_line
from .target import app_option, json_option, mq_url_option, resolve


def _created(message: WireMessage) -> str:
    value = message.headers.get("x-created-at")
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    if message.timestamp:
        return datetime.fromtimestamp(message.timestamp, UTC).isoformat()
    return datetime.now(UTC).isoformat()


def _payload(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return body.decode("utf-8", "replace")


@click.command()
@click.argument("patterns", metavar="PATTERN...", nargs=-1, required=True)
@click.option(
    "--exchange",
    metavar="NAME",
    default=EVENTS_EXCHANGE,
    show_default=True,
    help="Exchange to listen on (a topic exchange: events, commands, dead_letter).",
)
@click.option("--count", type=click.IntRange(min=1), metavar="N", help="Exit after N messages.")
@app_option
@mq_url_option
@json_option
def tail(
    patterns: tuple[str, ...],
    exchange: str,
    count: int | None,
    as_json: bool,
    **options: str | None,
) -> None:
    """Print messages matching topic PATTERN (e.g. 'orders.#', 'orders.order.*') live.

    Each message is a copy, taken through a server-named, exclusive, auto-delete queue bound
    to the exchange with PATTERN; the broker deletes the queue when the command exits (Ctrl-C,
    SIGTERM, --count reached, or a crash). The services' own queues are not touched.
    One line per message: created-at, routing key, message id, payload; --json prints one
    JSON object per line.

    Watching `commands`: a command that only the tail queue matches is consumed by the tail
    instead of going to `unroutable`. Tail commands only for services that have a queue.
    """
    for pattern in patterns:
        if not Filters.is_pattern(pattern):
            raise click.BadParameter(f"{pattern!r} is not a topic pattern", param_hint="PATTERN")
    target = resolve(**options)
    stop = _stop_on_signals()
    if exchange == COMMANDS_EXCHANGE:
        echo(
            "warning: a command that only this tail matches is consumed here, not kept in "
            "`unroutable`",
            err=True,
        )
    seen = 0

    def on_ready(queue: str) -> None:
        echo(
            f"listening on exchange {exchange!r} for {', '.join(patterns)} through queue "
            f"{queue} (deleted on exit); Ctrl-C to stop",
            err=True,
        )

    def on_message(message: WireMessage) -> bool:
        nonlocal seen
        if not any(topic_matches(p, message.routing_key) for p in patterns):
            # A fanout or direct exchange routes by other rules than a topic pattern: the
            # pattern is applied here too, so `--exchange unroutable '#'` works as expected.
            return True
        seen += 1
        echo(_render(message, as_json))
        return count is None or seen < count

    with target.broker().operator() as admin:
        admin.tail(
            exchange,
            list(patterns),
            on_ready=on_ready,
            on_message=on_message,
            should_stop=stop.is_set,
        )
    if not as_json:
        echo(f"{seen} message(s); tail queue deleted", err=True)


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def _render(message: WireMessage, as_json: bool) -> str:
    """One line for a message: created-at, routing key, id and payload, or a JSON object."""
    payload = _payload(message.body)
    if as_json:
        return json.dumps(
            {
                "created_at": _created(message),
                "exchange": message.exchange,
                "routing_key": message.routing_key,
                "message_id": message.message_id,
                "correlation_id": message.correlation_id,
                "app_id": message.app_id,
                "headers": {k: _text(v) for k, v in message.headers.items()},
                "payload": payload,
            },
            default=str,
            ensure_ascii=False,
        )
    shown = json.dumps(payload, ensure_ascii=False, default=str)
    return (
        f"{_created(message)}  {message.routing_key}  {message.message_id or '-'}  "
        f"{one_line(shown, 400)}"
    )


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, datetime):
        return value.isoformat()
    return value
