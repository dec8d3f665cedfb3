"""The services the dashboard shows, and the dead-letter work it does on them.

Everything here goes through outbox_inbox.status.health and outbox_inbox.dead_letters.DeadLetters,
the functions behind `outbox-inbox status` and `dead-letters`: the dashboard shows the same
numbers and acts the same way (by message id: see `act`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from ..broker import Broker
from ..dead_letters import ACTIONS, DeadLetters, Filters, Outcome, Selection
from ..errors import OutboxInboxError
from ..service import Service
from ..status import Health, health
from ..tables import Tables

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchedService:
    """One service on the dashboard: its name, tables, database, and broker (None: the
    broker's queues are not shown and its sources are not offered); `tenants`: whose to show."""

    name: str
    engine: Engine
    tables: Tables
    broker: Broker | None = None
    tenants: Service | None = None

    @property
    def dead_letters(self) -> DeadLetters:
        """The library's dead letters of this service: the CLI's implementation."""
        return DeadLetters(
            engine=self.engine, tables=self.tables, broker=self.broker, service=self.name
        )

    def sources(self) -> list[str]:
        """The dead-letter sources this service can read, in the CLI's order."""
        return self.dead_letters.reachable()[0]

    def health(self, *, max_lag: float | None = None) -> Health:
        """Its `health`, with its queues when it has a broker (no wake-ups: a page shows none)."""
        return health(
            self.engine,
            self.tables,
            service=self.name,
            broker=self.broker,
            wakeups=False,
            max_lag=max_lag,
            tenants=self.tenants,
        )


#: Writes the audit line of an action: keyword arguments of outbox_inbox.audit_trail.write_audit
#: (command, service, source, filters, counts, message_ids, dry_run, error, and `client`).
AuditWriter = Callable[..., Any]


@dataclass
class ActionResult:
    """What an action did: its outcome, or the error that stopped it."""

    action: str
    source: str
    requested: list[str]
    outcome: Outcome | None
    error: str | None

    @property
    def done(self) -> list[str]:
        return self.outcome.done if self.outcome else []

    @property
    def kept(self) -> list[tuple[str, str]]:
        return self.outcome.kept if self.outcome else []

    @property
    def missing(self) -> list[str]:
        """Message ids asked for that were not dead letters of the source any more."""
        seen = set(self.done) | {m for m, _ in self.kept}
        return [m for m in self.requested if m not in seen]


def act(
    service: WatchedService,
    action: str,
    source: str,
    message_ids: list[str],
    *,
    audit: AuditWriter,
    client: str,
    fingerprint: str | None = None,
    parked: bool = False,
) -> ActionResult:
    """Replay, purge or park (`DeadLetters.act`) the dead letters `message_ids` of `source`,
    and write one audit line, even when the action fails half-way. `fingerprint`: only those
    still of that group; `parked`: the ids are parked rows. The selection is made again, by id:
    a letter acted on by someone else meanwhile is reported missing, never acted on twice.
    Errors of the servers are returned in the result, not raised."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    if not message_ids:
        raise ValueError("no message id given")
    filters = Filters(message_ids=tuple(message_ids), fingerprint=fingerprint, parked=parked)
    outcome: Outcome | None = None
    selection: Selection | None = None
    error: str | None = None
    try:
        with service.dead_letters.select([source], filters) as (selection,):
            outcome = service.dead_letters.act(action, selection)
    except OutboxInboxError as exc:
        error = str(exc)
        log.warning("dashboard %s failed", action, extra={"service": service.name, "error": error})
    except BaseException as exc:  # recorded in the audit line, then raised on
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if outcome is None and selection is not None:
            outcome = selection.outcome  # what was done before the failure, if anything
        audit(
            command=f"dashboard {action}",
            service=service.name,
            source=source,
            filters=filters.as_dict(),
            counts={source: len(outcome.done) if outcome else 0},
            message_ids=outcome.done if outcome else [],
            dry_run=False,
            error=error,
            client=client,
        )
    return ActionResult(action, source, list(message_ids), outcome, error)
