"""Webhooks out: events delivered to HTTP endpoints, signed as Standard Webhooks 1.0 says. Each
event an endpoint's patterns match gets a delivery row of its own in the outbox (exchange
``webhook:<name>``, `outbox.delivery_rows`), which the `WebhookRole` POSTs (docs/concepts.md)."""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from typing import Any, TypeAlias

from sqlalchemy import Connection, Engine

from .claim_check import read
from .config import Settings
from .errors import ConfigurationError, PayloadMissing, first_line
from .faults import Fault
from .outbox import Outbox
from .queries import roles
from .role_loop import RoleLoop
from .tables import WEBHOOK, Tables

log = logging.getLogger(__name__)

#: The most rows one thread claims at once: POSTed one after another, marked together.
_BATCH = 10

#: The dead reasons of a delivery: every attempt of the schedule failed; the endpoint said 410.
EXHAUSTED, GONE = "exhausted", "gone"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_SECRET = re.compile(r"whsec_(?:[A-Za-z0-9+/]{4})+(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
Answer: TypeAlias = int | str | PayloadMissing  # of `post`


@dataclass(frozen=True, kw_only=True)
class Webhook:
    """An HTTP endpoint subscribed to events (the `webhooks` setting; its fields:
    docs/configuration.md, "Webhooks"). `url` and `secrets` are never logged."""

    name: str
    url: str = field(repr=False)
    patterns: tuple[str, ...]
    secrets: tuple[str, ...] = field(repr=False)
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigurationError(f"invalid webhook name {self.name!r}")
        if not str(self.url).startswith(("http://", "https://")):
            raise ConfigurationError(f"webhook {self.name}: the url must be http(s)")
        for name in ("patterns", "secrets"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if not self.patterns or not self.secrets:
            raise ConfigurationError(f"webhook {self.name}: needs patterns and secrets")
        if not all(isinstance(s, str) and _SECRET.fullmatch(s) for s in self.secrets):
            raise ConfigurationError(f"webhook {self.name}: a secret must be whsec_<base64>")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ConfigurationError(f"webhook {self.name}: max_in_flight must be >= 1")


def signature(secrets: tuple[str, ...], webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,<base64 HMAC-SHA256>`` of
    ``<id>.<timestamp>.<body>`` for each secret, separated by spaces."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.digest(base64.b64decode(s[6:]), signed, "sha256")).decode()
        for s in secrets
    )


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx is an answer: an HTTPError, so a failed attempt


_OPENER = urllib.request.build_opener(_NoRedirect)


def post(hook: Webhook, row: Mapping[Any, Any], timeout: float, stores: Any = ()) -> Answer:
    """POST one delivery row to `hook`: the HTTP status, or the error (no answer, the store of
    its payload by reference unreadable now), or PayloadMissing (`claim_check.read`)."""
    event = {"type": row["routing_key"], "timestamp": row["created_at"].isoformat()}
    body = json.dumps({**event, "data": row["payload"]}, separators=(",", ":")).encode()
    try:
        if (data := read(row["headers"] or {}, stores)) is not None:  # its bytes, not decoded
            body = body.removesuffix(b"null}") + data + b"}"
    except PayloadMissing as exc:
        return exc  # dead at once, as at a worker
    except Exception as exc:  # a failed attempt, retried on the schedule
        return f"payload store: {first_line(exc)}"[:200]
    webhook_id, timestamp = row["causation_id"], int(time.time())
    headers = {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(hook.secrets, webhook_id, timestamp, body),
    }
    request = urllib.request.Request(hook.url, body, headers, method="POST")  # noqa: S310 - http(s) only (Webhook)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            response.read(65536)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a malformed answer
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return f"no answer: {first_line(reason)}"[:200]


class WebhookRole:
    """Delivers the webhook rows of a service: `max_in_flight` threads per endpoint, each
    sending one request at a time. At least once: receivers dedupe on ``webhook-id``."""

    def __init__(self, *, service: str, engine: Engine, tables: Tables, settings: Settings) -> None:
        self._service, self._engine, self._tables = service, engine, tables
        self._settings, self._stores = settings, (settings.payload_store, *settings.payload_sources)
        # Its fault events get no deliveries of their own.
        self._faults = Outbox(service, tables, settings=replace(settings, webhooks=()))
        self.delivered = self.failed = self.dead = 0  # for tests and status

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Deliver until `stop` is set; each thread finishes the request in hand first."""
        s, threads = self._settings, []
        for hook, n in ((h, n) for h in s.webhooks for n in range(h.max_in_flight)):
            what = f"webhook {hook.name} of {self._service}"
            loop = RoleLoop(what, s, log, poll_interval=s.relay_poll_interval, retried=(Exception,))
            step, name = partial(self.deliver, hook, stop), f"outbox-inbox-{what}-{n}"
            thread = threading.Thread(target=loop.run, args=(stop, step), name=name, daemon=True)
            thread.start()
            threads.append(thread)
        if on_started:
            on_started()
        for thread in threads:
            thread.join()

    def deliver(self, hook: Webhook, stop: threading.Event | None = None) -> int:
        """Claim up to `_BATCH` due rows of `hook`, POST them one by one and mark them in one
        transaction; return how many were claimed. After a request without an answer, or once
        `stop` is set, the rest go back unsent, due at once, with no attempt counted."""
        s, t = self._settings, self._tables
        with self._engine.begin() as conn:
            roles.bound_on_server(conn, flush_wait=False)  # a claim a crash undoes: sent later
            lease = _BATCH * s.webhook_timeout + 60
            rows = roles.claim_webhooks(conn, t, WEBHOOK + hook.name, _BATCH, lease)
        answers: list[tuple[Any, Answer]] = []
        for row in rows:
            if (stop and stop.is_set()) or any(isinstance(a, str) for _, a in answers):
                break
            answers.append((row, post(hook, row, s.webhook_timeout, self._stores)))
        with self._engine.begin() as conn:
            roles.bound_on_server(conn, flush_wait=False)  # a mark a crash undoes: sent again
            roles.release_webhooks(conn, t, [row["id"] for row in rows[len(answers) :]])
            ok = [row["id"] for row, a in answers if isinstance(a, int) and 200 <= a < 300]
            roles.mark_published(conn, t, ok)
            self.delivered += len(ok)
            for row, answer in answers:
                if row["id"] not in ok:
                    self._failed(conn, hook, row, answer)
        return len(rows)

    def _failed(self, conn: Connection, hook: Webhook, row: Any, answer: Answer) -> None:
        """Mark a failed attempt: due after the schedule's next wait, or dead with its fault."""
        s, t = self._settings, self._tables
        error = f"webhook {hook.name}: {f'HTTP {answer}' if isinstance(answer, int) else answer}"
        attempt = row["attempts"]  # of the schedule: 0 was the immediate one
        stop = GONE if answer == 410 else getattr(answer, "dead_reason", None)  # no retry
        if not stop and attempt < len(s.webhook_schedule):
            wait = timedelta(seconds=s.webhook_schedule[attempt])
            roles.mark_publish_failed(conn, t, [row["id"]], error, wait)
            self.failed += 1
            log.info("%s (attempt %d)", error, attempt + 1)
            return
        reason = stop or EXHAUSTED
        roles.mark_outbox_dead(conn, t, [row["id"]], reason, error)
        # The Fault's message_id, routing_key, kind, service; reason, fingerprint, error, ...
        ids = (row["causation_id"], row["routing_key"], WEBHOOK + hook.name, self._service)
        fault = Fault(*ids, reason, reason, error, row["correlation_id"])
        self._faults.publish(conn, "webhook.exhausted", fault)
        self.dead += 1
        log.error("%s: event %s dead (%s)", error, row["causation_id"], reason)


__all__ = ["EXHAUSTED", "GONE", "Webhook", "WebhookRole", "signature"]
