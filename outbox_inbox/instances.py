"""Rolling deploys: the instances table in which workers advertise their handlers, and the
rows a worker has no handler for, left to a live instance that has one."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from .config import Settings
from .handlers import Handlers, handled_by
from .queries import roles
from .queries.roles import Claimed
from .tables import Tables

log = logging.getLogger(__name__)


class Instances:
    """Worker `name`'s row of the instances table of `service` (None: it advertises nothing,
    and a row it has no handler for is dead at once)."""

    def __init__(
        self, tables: Tables, handlers: Handlers, settings: Settings, service: str | None, name: str
    ) -> None:
        self._tables, self._handlers, self._service, self.name = tables, handlers, service, name
        self._grace = settings.no_handler_grace
        self._advertised_at = -float("inf")
        #: When each (kind, routing key, version) left to others was last warned of (monotonic).
        self._warned: dict[tuple[str, str, int], float] = {}

    def advertise(self, conn: Connection) -> None:
        """Refresh the worker's row (its handlers, seen now) when a quarter of
        ``no_handler_grace`` has passed since the last time: in its own short transaction,
        before a claim, so that a busy worker stays live as an idle one does."""
        if self._service is None or time.monotonic() - self._advertised_at < self._grace / 4:
            return
        with conn.begin():
            roles.advertise_instance(
                conn,
                self._tables,
                self._service,
                self.name,
                self._handlers.advertised(),
                forget_after=timedelta(seconds=10 * self._grace),
            )
        self._advertised_at = time.monotonic()

    def retire(self, conn: Connection) -> None:
        """Delete the worker's row: it stops, and no longer keeps messages only it could handle
        waiting. A database error is only logged: the row stops counting at ``no_handler_grace``."""
        if self._service is None or conn.invalidated or conn.closed:
            return
        try:
            with conn.begin():
                roles.forget_instance(conn, self._tables, self._service, self.name)
        except SQLAlchemyError as exc:
            log.debug("worker %s: forgetting its instance row failed: %s", self.name, exc)
        self._advertised_at = -float("inf")

    def leave(
        self, conn: Connection, rows: list[Claimed], claimant: str
    ) -> list[tuple[Claimed, str]]:
        """Decide the claimed `rows` no handler of this worker takes, in the batch's
        transaction; return those to be dead (``no_handler``), each with its error. A row a
        live instance has a handler for is given back uncounted and still pending, its key's
        later rows behind it; one warning per routing key and version a minute says so."""
        if not rows:
            return []
        grace, service = timedelta(seconds=self._grace), self._service
        live = [] if service is None else roles.live_instances(conn, self._tables, service, grace)
        left: list[int] = []
        dead: list[tuple[Claimed, str]] = []
        for row in rows:
            kind, key, version = row["kind"], row["routing_key"], row["version"]
            others = [i["instance"] for i in live if handled_by(i["handlers"], kind, key, version)]
            if others:
                left.append(row["id"])
                self._warn(kind, key, version, others)
                continue
            log.error(
                "worker %s: no handler for %s %s version %d here, nor on any instance seen in"
                " the last %gs; dead",
                self.name,
                kind,
                key,
                version,
                self._grace,
            )
            dead.append((row, f"no handler for {key} version {version} on any live instance"))
        roles.release_claims(conn, self._tables, left, claimant, away=True)
        return dead

    def _warn(self, kind: str, key: str, version: int, others: list[str]) -> None:
        """Log that this worker leaves (kind, key, version) to `others`: once a minute."""
        now = time.monotonic()
        if now - self._warned.get((kind, key, version), -float("inf")) < 60:
            return
        if len(self._warned) >= 10_000:  # routing keys come from senders: keep it bounded
            self._warned.clear()
        self._warned[(kind, key, version)] = now
        log.warning(
            "worker %s (service %s) has no handler for %s %s version %d: left, uncounted, to"
            " live instances that have one: %s",
            self.name,
            self._service,
            kind,
            key,
            version,
            ", ".join(sorted(others)[:3]) + (" …" if len(others) > 3 else ""),
        )
