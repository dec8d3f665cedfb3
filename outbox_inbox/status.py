"""The health of one service's messaging, from its tables and queues (`outbox-inbox status`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from . import errors, migrate
from .broker import Broker, Operator
from .dead_letters import error_summary
from .errors import BrokerError, SchemaMissing, storage_error
from .logsafe import mask_text
from .queries import operations
from .tables import Tables
from .topology import UNROUTABLE_QUEUE, dead_letter_queue, inbox_queue
from .waker import Waker, notify_channel, psycopg_conninfo

if TYPE_CHECKING:
    from .service import Service


@dataclass(frozen=True)
class Health:
    """One service's messaging health now, as `outbox-inbox status` prints it (`as_dict`: its
    --json) and the dashboard shows it; `problems` is empty when healthy. The sections are those
    of `collect_status`; `broker` is None when the broker was not asked, `wakeups` (see
    `wakeup_status`) when they were not probed, `tenants` (`tenant_status`) without tenants.
    All ages are on the database clock."""

    service: str | None
    schema: str | None
    database_time: str
    outbox: Mapping[str, Any]
    inbox: Mapping[str, Any]
    held_keys: Mapping[str, Any]
    broker: Mapping[str, Any] | None
    wakeups: Mapping[str, Any] | None
    problems: tuple[str, ...]
    tenants: Mapping[str, Any] | None = None

    @property
    def healthy(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """Every field, and ``healthy``, as `outbox-inbox status --json` prints them."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "problems"}
        return {**out, "healthy": self.healthy, "problems": list(self.problems)}


def health(
    engine: Engine,
    tables: Tables,
    *,
    service: str | None,
    broker: Broker | None = None,
    listen_url: str | None = None,
    wakeups: bool = True,
    held_keys_limit: int = 20,
    max_lag: float | None = None,
    max_dead: int | None = None,
    tenants: Service | None = None,
) -> Health:
    """`collect_status` of `service` (with its queues through `broker.operator()` when a
    `broker` is given), the `wakeup_status` of `listen_url` unless not `wakeups`, the
    `tenant_status` of `tenants`' registry, and the `problems` under `max_lag` (seconds) and
    `max_dead`. Raises what `collect_status` raises (and ConfigurationError for a broken tenant
    registry); a broker that cannot be asked is one of the problems."""
    with broker.operator() if broker is not None else contextlib.nullcontext() as admin:
        report = collect_status(
            engine, tables, service=service, admin=admin, held_keys_limit=held_keys_limit
        )
    report["wakeups"] = wakeup_status(engine, tables, listen_url) if wakeups else None
    report["tenants"] = None if tenants is None else tenant_status(tenants, max_lag)
    return Health(**report, problems=tuple(problems(report, max_lag=max_lag, max_dead=max_dead)))


def collect_status(
    engine: Engine,
    tables: Tables,
    *,
    service: str | None,
    admin: Operator | None,
    held_keys_limit: int = 20,
) -> dict[str, Any]:
    """Outbox backlog, inbox states, held-back ordering keys and, with `admin`, queue depths.

    All ages are measured on the database clock. Reads in one repeatable-read transaction, so
    the numbers agree with each other. Raises SchemaMissing without the tables, StorageError
    when the database fails; a broker that cannot be reached is reported in ``broker.error``."""
    try:
        with engine.connect() as conn:
            if not migrate.tables_exist(conn, tables.schema):
                raise SchemaMissing(
                    f"the outbox/inbox tables are missing in schema {tables.schema!r}: "
                    "run `outbox-inbox db upgrade`"
                )
            conn.commit()  # the inspection began a transaction; the snapshot starts below
            # SQLite's transactions are serializable already and it knows no REPEATABLE READ.
            snapshot = "REPEATABLE READ" if engine.dialect.name == "postgresql" else "SERIALIZABLE"
            with conn.execution_options(isolation_level=snapshot).begin():
                now = operations.database_now(conn)
                outbox = operations.outbox_status(conn, tables)
                inbox = operations.inbox_status(conn, tables)
                total, keys = operations.held_keys(conn, tables, held_keys_limit)
    except SQLAlchemyError as exc:
        where = engine.url.render_as_string(hide_password=True)
        raise storage_error(exc, f"reading the status from {where}") from exc
    return {
        "service": service,
        "schema": tables.schema,
        "database_time": now.isoformat(),
        "outbox": outbox,
        "inbox": inbox,
        "held_keys": {
            "count": total,
            "keys": [
                {
                    "key": k["key"],
                    "message_id": str(k["message_id"]),
                    "type": k["type"],
                    "failures": int(k["failures"]),
                    "next_attempt_at": k["next_attempt_at"].isoformat(),
                    "waiting": int(k["waiting"]),
                    "last_error": error_summary(k["last_error"]),
                }
                for k in keys
            ],
        },
        "broker": None if admin is None else _broker_status(admin, service),
    }


def wakeup_status(engine: Engine, tables: Tables, listen_url: str | None) -> dict[str, Any]:
    """How the roles of a service on `engine` are woken, proven by their own self-NOTIFY probe
    (outbox_inbox.waker) on `listen_url`, else the engine's URL: ``mode`` is ``notify``,
    ``polling``, ``unknown`` (the database could not be asked) or None (SQLite: the roles poll);
    ``via`` names the setting the LISTEN path comes from."""
    if engine.dialect.name != "postgresql":
        return {"mode": None, "via": None}
    channel = notify_channel(tables.schema or "", tables.outbox.name)
    conninfo = psycopg_conninfo(listen_url or engine.url)
    with contextlib.closing(Waker(conninfo, channel, threading.Event(), probe=engine)) as waker:
        mode = {True: "notify", False: "polling", None: "unknown"}[waker.check()]
    return {"mode": mode, "via": "listen_url" if listen_url else "db_url"}


#: Without --max-lag, how long a tenant's oldest unsent or pending row may wait before
#: `problems` calls the tenant never drained.
NEVER_DRAINED_AFTER = 300.0
#: Tenants read by one statement (a transaction) on a database they share: it locks every
#: table, partition and index it reads, and PostgreSQL's lock table holds some thousands.
TENANTS_PER_STATEMENT = 10


def tenant_status(service: Service, max_lag: float | None = None) -> dict[str, Any] | None:
    """The backlog of each tenant of `service` (None without any) in its database and schema
    (`Service.tenant`), one statement per database: totals (``count``, ``waiting``, ``outbox``
    rows unsent, ``inbox`` rows pending, ``unreachable``, ``never_drained``: lag over `max_lag`,
    else ``drain_bound``) and the `operations.TOP_TENANTS` unreachable or with the largest lag
    and backlog (``top``: ``tenant``, ``outbox``, ``inbox``, ``lag_seconds``, ``error``)."""
    groups: dict[Engine, list[tuple[str, Tables]]] = {}
    rows: list[dict[str, Any]] = []
    for tenant in service.tenant_ids():
        try:
            copy = service.tenant(tenant)
            groups.setdefault(copy.engine, []).append((tenant, copy.tables))
        except errors.ConfigurationError as exc:
            rows += _unread([tenant], mask_text(exc, service.settings.db_url))
    for engine, tenants in groups.items():
        rows += _read_tenants(engine, tenants)
    if not rows:
        return None
    bound = NEVER_DRAINED_AFTER if max_lag is None else max_lag
    rows.sort(key=lambda r: (not r["error"], -(r["lag_seconds"] or 0), -r["backlog"], r["tenant"]))
    return {
        "count": len(rows),
        **{k: sum(r[k] or 0 for r in rows) for k in ("outbox", "inbox")},
        "waiting": sum(r["backlog"] > 0 for r in rows),
        "unreachable": sum(r["error"] is not None for r in rows),
        "never_drained": sum((r["lag_seconds"] or 0) > bound for r in rows),
        "drain_bound": bound,
        "top": rows[: operations.TOP_TENANTS],
    }


def _read_tenants(engine: Engine, tenants: list[tuple[str, Tables]]) -> list[dict[str, Any]]:
    """`operations.tenant_backlogs` on one connection; when it fails, unless the database cannot
    be reached, each tenant apart (a schema without tables fails the statement of them all)."""
    found: list[Any] = []
    try:
        with engine.connect() as conn:
            for start in range(0, len(tenants), TENANTS_PER_STATEMENT):
                found += operations.tenant_backlogs(conn, tenants[start:][:TENANTS_PER_STATEMENT])
                conn.rollback()  # its locks, some 150 a tenant (partitions, indexes), go
    except SQLAlchemyError as exc:
        if len(tenants) > 1 and not errors.database_unreachable(exc):
            return [row for t in tenants for row in _read_tenants(engine, [t])]
        url = engine.url.render_as_string(hide_password=False)
        error = mask_text(storage_error(exc, "reading its backlog"), url)
        return _unread([t for t, _ in tenants], error)
    lag = ((r, float(r["lag_seconds"]), r["outbox"] + r["inbox"]) for r in found)
    return [{**r, "lag_seconds": age, "backlog": n, "error": None} for r, age, n in lag]


def _unread(tenants: list[str], error: str) -> list[dict[str, Any]]:
    unknown = dict.fromkeys(("outbox", "inbox", "lag_seconds"))
    return [{"tenant": t, **unknown, "backlog": 0, "error": error} for t in tenants]


def _broker_status(admin: Operator, service: str | None) -> dict[str, Any]:
    names = [inbox_queue(service), dead_letter_queue(service)] if service else []
    names.append(UNROUTABLE_QUEUE)
    queues: dict[str, Any] = {}
    try:
        for name in names:
            info = admin.queue_info(name)
            queues[name] = None if info is None else {"messages": info[0], "consumers": info[1]}
        blocked = admin.flow_control()
    except BrokerError as exc:
        return {"error": str(exc), "queues": queues, "blocked": None}
    return {"error": None, "queues": queues, "blocked": blocked}


def dead_count(status: dict[str, Any]) -> int:
    """Dead inbox and outbox rows plus the messages in the service's dead-letter queue and in
    `unroutable` (commands sent to a service with no queue, of every service), when known."""
    count = int(status["inbox"]["dead"]) + int(status["outbox"].get("dead", 0))
    queues = (status.get("broker") or {}).get("queues") or {}
    service = status.get("service")
    for name in (dead_letter_queue(service) if service else None, UNROUTABLE_QUEUE):
        count += int((queues.get(name) or {}).get("messages", 0))
    return count


#: Without a lag bound, how long inbox rows may wait claimable, none in progress or handled,
#: before `problems` says no worker runs (the default lease: a dead worker's rows wait as long).
STALLED_AFTER = 60.0


def problems(
    status: dict[str, Any], *, max_lag: float | None = None, max_dead: int | None = None
) -> list[str]:
    """What makes `status` unhealthy under the thresholds given, as docs/cli.md ("status")
    lists it: tenants unreachable or never drained, lag, a stalled inbox (`_stalled`, even
    without thresholds), dead letters, the broker, the inbox queue. Empty when healthy."""
    out = []
    for t in (tenants := status.get("tenants") or {}).get("top", ()):
        if t["error"]:
            out.append(f"tenant {t['tenant']} unreachable: {t['error']}")
        elif (lag := t["lag_seconds"]) > (bound := tenants["drain_bound"]):
            out.append(f"tenant {t['tenant']} never drained for {lag:.0f}s (> {bound:g}s)")
    if more := tenants and tenants["unreachable"] + tenants["never_drained"] - len(out):
        out.append(f"... and {more} more tenants unreachable or never drained")
    lags = (("outbox", "oldest_age_seconds"), ("inbox", "oldest_pending_age_seconds"))
    if max_lag is not None:
        for part, field in lags:
            age = status[part][field]
            if age is not None and age > max_lag:
                out.append(f"{part} lag {age:.1f}s exceeds --max-lag {max_lag:g}s")
    if stalled := _stalled(status["inbox"], STALLED_AFTER if max_lag is None else max_lag):
        out.append(stalled)
    if max_dead is not None and (dead := dead_count(status)) > max_dead:
        letters = "dead letter exceeds" if dead == 1 else "dead letters exceed"
        out.append(f"{dead} {letters} --max-dead {max_dead}")
    broker = status.get("broker")
    if broker and broker.get("error"):
        out.append(f"broker: {broker['error']}")
    if broker and broker.get("blocked"):
        out.append(f"broker blocks publishers: {broker['blocked']}")
    name = inbox_queue(status["service"]) if status.get("service") else ""
    if broker and name in broker["queues"]:
        queue = broker["queues"][name]
        if queue is None:
            out.append(f"queue {name} is missing: no receiver runs (or none could declare it)")
        elif queue["messages"] and not queue["consumers"]:
            out.append(f"queue {name} holds {queue['messages']} message(s) and no consumer")
    return out


def _stalled(inbox: dict[str, Any], bound: float) -> str | None:
    """Why no worker seems to run (rows claimable for over `bound` seconds, none in progress,
    none handled in that time), or None."""
    waited = inbox.get("oldest_claimable_age_seconds")
    if waited is None or waited <= bound or inbox["in_progress"]:
        return None
    handled = inbox.get("last_handled_age_seconds")
    if handled is not None and handled <= bound:
        return None
    last = "never" if handled is None else f"{handled:.0f}s ago"
    return (
        f"inbox stalled: {inbox['claimable']} row(s) claimable for up to {waited:.0f}s, none "
        f"in progress, last handled {last}: no worker has claimed for over {bound:g}s "
        "(is a worker running?)"
    )


def subscribed_services(engine: Engine, tables: Tables) -> list[str]:
    """The services the subscriptions table names (each records its own at topology time)."""
    try:
        with engine.connect() as conn:
            return sorted({str(r["service"]) for r in operations.subscriptions_of(conn, tables)})
    except SQLAlchemyError as exc:
        raise storage_error(exc, "reading the subscriptions") from exc


__all__ = ["Health", "health"]
