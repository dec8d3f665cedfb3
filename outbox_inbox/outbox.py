"""Writing messages into the outbox table, in the caller's transaction."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from .config import Settings, validate_service_name
from .context import current_message
from .errors import MessageError, storage_error
from .messages import (
    COMMAND,
    COMMANDS_EXCHANGE,
    EVENT,
    EVENTS_EXCHANGE,
    H_PAYLOAD_REF,
    H_PAYLOAD_SHA256,
    H_PAYLOAD_SIZE,
    H_TENANT,
    check_headers,
    payload_json,
)
from .payloads import plain
from .queries import roles
from .tables import WEBHOOK, Tables
from .topology import topic_matches
from .tracing import Tracing, creating

if TYPE_CHECKING:
    from .webhooks import Webhook

_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


def _check_name(value: str, what: str) -> str:
    """A message name: dot-separated words, no wildcards, e.g. ``order.placed``."""
    if not isinstance(value, str) or not value:
        raise MessageError(f"{what} must be a non-empty string")
    if not _NAME.fullmatch(value):
        raise MessageError(
            f"invalid {what} {value!r}: use dot-separated words of letters, digits, _ and -"
        )
    return value


class WriteKeywords(TypedDict, total=False):
    """The keywords of `Outbox.publish` and `send` and their async twins: the fields of
    `WriteOptions` (for type checkers; tests/unit/test_options.py holds them equal)."""

    key: str | None
    tenant: str | None
    headers: Mapping[str, Any] | None
    correlation_id: str | None
    message_id: uuid.UUID | None
    priority: int | None
    ttl: float | timedelta | None
    version: int
    delay: float | timedelta | None


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How one message is written, besides its name and payload; `Outbox._row` checks them. `key`:
    the ordering key (at most 255 characters). `tenant`: whose work it is (at most 255 characters;
    else the handled message's): fair claims serve tenants in turn. `headers`: the sender's, JSON
    values, none reserved. `correlation_id`: else the handled message's, else the new message id.
    `message_id`: else a new UUID. `priority`: 0..255. `ttl`: seconds (or a timedelta) after which
    it expires unhandled. `version`: the payload version, >= 1. `delay`: seconds (or a timedelta)
    before it is sent."""

    key: str | None = None
    tenant: str | None = None
    headers: Mapping[str, Any] | None = None
    correlation_id: str | None = None
    message_id: uuid.UUID | None = None
    priority: int | None = None
    ttl: float | timedelta | None = None
    version: int = 1
    delay: float | timedelta | None = None


class Outbox:
    """Writes messages of one service into its outbox table.

    Both methods add one row in the given `Session` or `Connection` and return the new message
    id. They never commit, flush-and-commit or open a transaction of their own: the message
    leaves if and only if the caller's transaction commits. They are thread-safe (no state).
    Raises `MessageError` for an invalid name, payload or header, `PayloadTooLarge` over the
    size limit, and `StorageError` if the database refuses the row.

    `settings` gives the size limit (`max_payload_bytes`) and the claim check (`payload_store`,
    docs/concepts.md "Large payloads"): StorageError when the store cannot be written.

    With tracing on (`tracing`), each write is a ``create`` span, a child of the current span,
    whose W3C context the row's headers keep as ``traceparent`` / ``tracestate``.

    `publish_async` and `send_async` are the same writes, awaited in the caller's `AsyncSession`
    or `AsyncConnection` (docs/async-services.md); the sync methods refuse those."""

    def __init__(
        self,
        service: str,
        tables: Tables,
        *,
        settings: Settings,
        tracing: Tracing | None = None,
        tenant: str = "",
    ) -> None:
        self._service = validate_service_name(service)
        self._tenant = tenant  # a tenant's outbox (`Service.tenant`): every write carries it
        self._tables = tables
        self._settings = settings  # max_payload_bytes and the claim check's
        self._tracing = tracing or Tracing(self._service)
        #: Called with the session of each write (a tenant's: `tenants.waking`).
        self.written: Callable[[Session | Connection], None] | None = None

    @property
    def service(self) -> str:
        """The service whose outbox this is (the ``app_id`` of what it writes)."""
        return self._service

    def publish(
        self,
        session: Session | Connection,
        event: str,
        payload: Any,
        **options: Unpack[WriteKeywords],
    ) -> uuid.UUID:
        """Publish event `event` (``entity.happened``) as ``<service>.<event>`` on `events`,
        written as `options` say (`WriteOptions`)."""
        _check_name(event, "event name")
        row = self._row(EVENT, EVENTS_EXCHANGE, f"{self._service}.{event}", payload, options)
        return self._insert(_sync(session), row)

    def send(
        self,
        session: Session | Connection,
        to_service: str,
        command: str,
        payload: Any,
        **options: Unpack[WriteKeywords],
    ) -> uuid.UUID:
        """Send `command` (``entity.verb``) to `to_service` as ``<to_service>.<command>``,
        written as `options` say (`WriteOptions`)."""
        validate_service_name(to_service)
        _check_name(command, "command name")
        row = self._row(COMMAND, COMMANDS_EXCHANGE, f"{to_service}.{command}", payload, options)
        return self._insert(_sync(session), row)

    async def publish_async(
        self,
        session: AsyncSession | AsyncConnection,
        event: str,
        payload: Any,
        **options: Unpack[WriteKeywords],
    ) -> uuid.UUID:
        """`publish`, awaited in the caller's `AsyncSession` or `AsyncConnection`: adds the row
        in the caller's transaction and never commits it. Raises what `publish` raises."""
        _check_name(event, "event name")
        row = self._row(EVENT, EVENTS_EXCHANGE, f"{self._service}.{event}", payload, options)
        return await self._insert_async(_async(session), row)

    async def send_async(
        self,
        session: AsyncSession | AsyncConnection,
        to_service: str,
        command: str,
        payload: Any,
        **options: Unpack[WriteKeywords],
    ) -> uuid.UUID:
        """`send`, awaited in the caller's `AsyncSession` or `AsyncConnection`: adds the row in
        the caller's transaction and never commits it. Raises what `send` raises."""
        validate_service_name(to_service)
        _check_name(command, "command name")
        row = self._row(COMMAND, COMMANDS_EXCHANGE, f"{to_service}.{command}", payload, options)
        return await self._insert_async(_async(session), row)

    async def _insert_async(
        self, session: AsyncSession | AsyncConnection, row: dict[str, Any]
    ) -> uuid.UUID:
        # run_sync runs the one insert path (writer locks, the insert the NOTIFY trigger sees)
        # on the caller's async connection: each statement is awaited on the async driver.
        with creating(self._tracing, row):  # the span is current in the caller's task
            await session.run_sync(self._write, row)
        return row["message_id"]  # type: ignore[no-any-return]

    def _insert(self, session: Session | Connection, row: dict[str, Any]) -> uuid.UUID:
        with creating(self._tracing, row):  # nothing at all when tracing is off
            self._write(session, row)
        return row["message_id"]  # type: ignore[no-any-return]

    def _write(self, session: Session | Connection, row: dict[str, Any]) -> None:
        """Put the row's offloaded payload, then insert it: the one write of both paths."""
        try:
            if (offloaded := row.pop("offloaded", None)) is not None:
                self._settings.payload_store.put(session, *offloaded)  # type: ignore[union-attr]
            hooks = self._settings.webhooks if row["kind"] == EVENT else ()
            roles.insert_outbox(session, self._tables, [row, *delivery_rows(row, hooks)])
            if self.written is not None:
                self.written(session)
        except SQLAlchemyError as exc:
            raise storage_error(exc, "writing to the outbox") from exc

    def _row(
        self, kind: str, exchange: str, routing_key: str, payload: Any, options: WriteKeywords
    ) -> dict[str, Any]:
        """The checked outbox row of one message, with the ids of the message being handled."""
        payload = plain(payload)  # a dataclass or pydantic model: its fields
        s, store = self._settings, self._settings.payload_store
        over = min(s.claim_check_types.get(routing_key, s.claim_check_bytes), s.max_payload_bytes)
        encoded = payload_json(payload, limit=None if store else s.max_payload_bytes)
        o = WriteOptions(**options)
        clean_headers = check_headers(o.headers)
        data = encoded.encode() if store and len(encoded) * 4 > over else b""
        offloaded = None
        if store and len(data) > over:  # the claim check: the payload goes by reference
            payload, encoded, offloaded = None, "null", (str(uuid.uuid4()), data)
            clean_headers[H_PAYLOAD_REF] = f"{store.name}/{offloaded[0]}"
            clean_headers[H_PAYLOAD_SIZE] = len(data)
            clean_headers[H_PAYLOAD_SHA256] = hashlib.sha256(data).hexdigest()
        for name in ("key", "tenant"):
            value = getattr(o, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > 255):
                raise MessageError(f"{name} must be a non-empty string of at most 255 characters")
        if o.priority is not None and (isinstance(o.priority, bool) or not 0 <= o.priority <= 255):
            raise MessageError("priority must be an int in 0..255")
        if not isinstance(o.version, int) or o.version < 1:
            raise MessageError("version must be an int >= 1")
        row: dict[str, Any] = {
            "message_id": o.message_id or uuid.uuid4(),
            "kind": kind,
            "exchange": exchange,
            "routing_key": routing_key,
            "payload": payload,
            "payload_json": encoded,  # inserted as it is (roles.insert_outbox)
            "headers": clean_headers,
            "version": o.version,
            "key": o.key,
            "priority": o.priority,
            # Seconds, not times: the database adds them to its own clock (insert_outbox).
            "ttl": _seconds(o.ttl, "ttl") if o.ttl is not None else None,
            "delay": _seconds(o.delay, "delay") if o.delay is not None else None,
            "offloaded": offloaded,  # put by `_write`, before the row
        }
        parent = current_message()
        if parent is not None:
            # The id its sender wrote (not the UUID the inbox derives from a foreign id), so
            # that a sender can match what a handler sends to the message it handled.
            row["correlation_id"] = o.correlation_id or parent.correlation_id or parent.original_id
            row["causation_id"] = parent.original_id
            tenant: str | None = o.tenant or parent.tenant
        else:  # a message written outside a handler starts a conversation
            row["correlation_id"] = o.correlation_id or str(row["message_id"])
            row["causation_id"] = None
            tenant = o.tenant
        if self._tenant and tenant not in (None, self._tenant):
            raise MessageError(f"tenant {self._tenant!r}'s outbox cannot write for {tenant!r}")
        tenant = self._tenant or tenant
        if tenant:
            clean_headers[H_TENANT] = tenant  # the row's headers: checked, then the tenant
        return row


def delivery_rows(row: Mapping[str, Any], webhooks: tuple[Webhook, ...]) -> list[dict[str, Any]]:
    """The delivery rows of an event's outbox `row`, one per endpoint whose patterns match:
    the event's id in causation_id (the requests' ``webhook-id``), no key, no time to live."""
    return [
        {
            **row,
            "message_id": uuid.uuid5(row["message_id"], hook.name),
            "exchange": WEBHOOK + hook.name,
            "causation_id": str(row["message_id"]),
            **dict.fromkeys(("key", "ttl"), None),
        }
        for hook in webhooks
        if any(topic_matches(p, row["routing_key"]) for p in hook.patterns)
    ]


def _sync(session: Any) -> Session | Connection:
    if isinstance(session, AsyncSession | AsyncConnection):
        raise MessageError(
            "an AsyncSession or AsyncConnection is written to with"
            " `await outbox.publish_async(...)` / `await outbox.send_async(...)`"
        )
    if not isinstance(session, Session | Connection):
        raise MessageError("pass the SQLAlchemy Session or Connection of your transaction")
    return session


def _async(session: Any) -> AsyncSession | AsyncConnection:
    if isinstance(session, Session | Connection):
        raise MessageError(
            "a sync Session or Connection is written to with outbox.publish(...) / send(...)"
        )
    if not isinstance(session, AsyncSession | AsyncConnection):
        raise MessageError("pass the AsyncSession or AsyncConnection of your transaction")
    return session


def _seconds(value: float | timedelta, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise MessageError(f"{what} must be seconds (a number) or a timedelta")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise MessageError(f"{what} must be a positive, finite number of seconds")
    return seconds


__all__ = ["Outbox", "WriteOptions"]
