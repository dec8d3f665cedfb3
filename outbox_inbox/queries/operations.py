"""The statements of the operators' tools: dead letters (list, count, group, replay, park,
purge), status and metrics, and a role's privileges."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, TypedDict, Unpack

from sqlalchemy import (
    Connection,
    Table,
    and_,
    case,
    delete,
    func,
    literal,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.engine import RowMapping
from sqlalchemy.sql.elements import ColumnElement

from ..clock import db_age, db_now, db_now_plus
from ..tables import DEAD, PARKED, PENDING, PROCESSED, WEBHOOK, Tables, outbox_unsent
from .roles import claimable, is_postgres, places_left


def database_now(conn: Connection) -> Any:
    """The database clock: leases and delays are judged by it, never by the host's."""
    return conn.execute(select(db_now())).scalar_one()


def dead_since(t: Any) -> Any:
    """When a dead row of table `t` died: the outbox's dead_at; on the inbox mark_dead sets
    processed_at, and older rows fall back to receipt."""
    if "status" not in t.c:
        return t.c.dead_at
    return func.coalesce(t.c.processed_at, t.c.received_at)


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


class DeadFilters(TypedDict, total=False):
    """The filters of a dead-row selection; a row matches every one given. ``routing_keys``:
    exact (topic patterns are matched by the caller); ``older_than``: died at least this long
    ago (database clock); ``error``: a case-insensitive substring of last_error; ``parked``:
    parked rows instead of dead."""

    routing_keys: Sequence[str]
    older_than: timedelta | None
    reason: str | None
    error: str | None
    message_ids: Sequence[uuid.UUID]
    fingerprint: str | None
    parked: bool


def dead_rows(conn: Connection, t: Table, **filters: Unpack[DeadFilters]) -> Iterator[RowMapping]:
    """Dead rows of table `t` (the inbox or the outbox) matching every given filter, in id
    order, streamed 500 at a time; each with ``dead_at`` (when it died) and ``age_seconds``."""
    dead_at = dead_since(t)
    died = [dead_at.label("dead_at")] if "status" in t.c else []  # the outbox has its dead_at
    stmt = select(t, *died, db_age(dead_at).label("age_seconds")).where(*_dead_where(t, filters))
    yield from conn.execute(stmt.order_by(t.c.id).execution_options(yield_per=500)).mappings()


def count_dead(conn: Connection, t: Table, **filters: Unpack[DeadFilters]) -> int:
    """How many dead rows of table `t` match every given filter: one count query, no row loaded."""
    stmt = select(func.count()).select_from(t).where(*_dead_where(t, filters))
    return int(conn.execute(stmt).scalar_one())


def _dead_where(t: Any, filters: DeadFilters) -> list[ColumnElement[bool]]:
    """The conditions of a dead-row selection of table `t`: dead (or parked), every filter."""
    where: list[ColumnElement[bool]] = []
    if routing_keys := filters.get("routing_keys"):
        where.append(t.c.routing_key.in_(list(routing_keys)))
    if (older_than := filters.get("older_than")) is not None:
        where.append(dead_since(t) <= db_now_plus(-older_than))
    if (reason := filters.get("reason")) is not None:
        where.append(t.c.dead_reason == reason)
    if (error := filters.get("error")) is not None:
        where.append(t.c.last_error.icontains(error, autoescape=True))
    if message_ids := filters.get("message_ids"):
        where.append(t.c.message_id.in_(list(message_ids)))
    where.append(_dead_or_parked(t, filters.get("parked", False)))
    if (fingerprint := filters.get("fingerprint")) is not None:
        where.append(t.c.fingerprint == fingerprint)
    return where


def _dead_or_parked(t: Any, parked: bool) -> ColumnElement[bool]:
    """The dead rows of table `t` (not an operator's parked rows), or the parked rows."""
    if "status" in t.c:
        state: ColumnElement[bool] = t.c.status == (PARKED if parked else DEAD)
        return state
    set_aside = t.c.parked_at.is_not(None) if parked else t.c.parked_at.is_(None)
    return and_(t.c.dead_at.is_not(None), set_aside)


def _change_dead(
    conn: Connection, t: Table, ids: Sequence[int], parked: bool, **values: Any
) -> list[int]:
    """Set `values` on the rows of `ids` still dead (`parked`: parked); return the ids changed."""
    if not ids:
        return []
    stmt = update(t).where(t.c.id.in_(list(ids)), _dead_or_parked(t, parked)).values(**values)
    return sorted(conn.execute(stmt.returning(t.c.id)).scalars())


def replay_dead(
    conn: Connection, t: Table, ids: Sequence[int], *, parked: bool = False
) -> list[int]:
    """Make the rows of `ids` of table `t` still dead (`parked`: parked) due now, their
    attempts reset and the replay counted; return the ids changed. last_error and the
    fingerprint stay as the history of the earlier failure until the next attempt ends."""
    if "status" in t.c:
        again: dict[str, Any] = {"status": PENDING, "next_attempt_at": db_now(), "finished": 0}
        again |= {"processed_at": None, "locked_until": None, "locked_by": None}
    else:
        again = {"dead_at": None, "parked_at": None, "available_at": db_now()}
    replayed = {"replays": t.c.replays + 1, "replayed_at": db_now()}
    return _change_dead(conn, t, ids, parked, attempts=0, dead_reason=None, **again, **replayed)


def purge_dead(
    conn: Connection, t: Table, ids: Sequence[int], *, parked: bool = False
) -> list[int]:
    """Delete the rows of `ids` of table `t` still dead (`parked`: parked); return their ids."""
    if not ids:
        return []
    stmt = delete(t).where(t.c.id.in_(list(ids)), _dead_or_parked(t, parked)).returning(t.c.id)
    return sorted(conn.execute(stmt).scalars())


def park_dead(conn: Connection, t: Table, ids: Sequence[int]) -> list[int]:
    """Set the rows of `ids` of table `t` that are still dead aside as parked; return their ids."""
    parked = {"status": PARKED} if "status" in t.c else {"parked_at": db_now()}
    return _change_dead(conn, t, ids, False, **parked)


def dead_groups(conn: Connection, tables: Tables, *, parked: bool = False) -> list[RowMapping]:
    """The dead (`parked`: parked) rows of the inbox and the outbox grouped by fingerprint,
    largest group first: each with ``fingerprint``, ``count``, ``types``, ``sources``
    ("table", "outbox"), ``first_seen`` and ``last_seen`` (when they died; a row replayed since
    counts from its arrival) and ``replayed`` (how many died again after a replay). Each table
    is first grouped by fingerprint and type (a hash aggregate over the partial index of its
    dead rows), then the few rows that gives by fingerprint."""
    i, o = tables.inbox, tables.outbox
    parts = []
    for t, source in ((i, "table"), (o, "outbox")):
        dead_at = dead_since(t)
        # A row replayed and dead again counts from its arrival: a replay moves no first_seen.
        arrived = t.c.received_at if "status" in t.c else t.c.created_at
        first = case((t.c.replays > 0, arrived), else_=dead_at)
        parts.append(
            select(
                t.c.fingerprint,
                t.c.routing_key,
                literal(source).label("source"),
                func.count().label("count"),
                func.min(first).label("first_seen"),
                func.max(dead_at).label("last_seen"),
                func.count().filter(t.c.replays > 0).label("replayed"),
            )
            .where(_dead_or_parked(t, parked))
            .group_by(t.c.fingerprint, t.c.routing_key)
        )
    rows = union_all(*parts).subquery()
    listed = func.array_agg if is_postgres(conn) else func.json_group_array
    count = func.sum(rows.c.count)
    stmt = (
        select(
            rows.c.fingerprint,
            count.label("count"),
            listed(rows.c.routing_key.distinct()).label("types"),
            listed(rows.c.source.distinct()).label("sources"),
            func.min(rows.c.first_seen).label("first_seen"),
            func.max(rows.c.last_seen).label("last_seen"),
            func.sum(rows.c.replayed).label("replayed"),
        )
        .group_by(rows.c.fingerprint)
        .order_by(count.desc(), rows.c.fingerprint)
    )
    return list(conn.execute(stmt).mappings())


def forget_deliveries(conn: Connection, tables: Tables, message_ids: Sequence[uuid.UUID]) -> int:
    """Reset the broker-redelivery counters of `message_ids` (a replayed message starts over)."""
    if not message_ids:
        return 0
    d = tables.deliveries
    result = conn.execute(delete(d).where(d.c.message_id.in_(list(message_ids))))
    return int(result.rowcount or 0)


#: Per webhook endpoint: deliveries waiting, of those failed at least once, dead; an error.
WEBHOOK_FIELDS = ("endpoint", "waiting", "failing", "dead", "last_error")


def outbox_status(conn: Connection, tables: Tables) -> dict[str, Any]:
    """Unsent outbox rows for the relay, how many of them failed at least once, the oldest
    one's age, the dead rows (webhook deliveries too), and ``webhooks``: `WEBHOOK_FIELDS` of
    each endpoint with deliveries waiting or dead (``last_error``: its newest one's)."""
    o = tables.outbox
    hook, unsent = o.c.exchange.startswith(WEBHOOK), outbox_unsent(o)
    row = conn.execute(
        select(
            func.count().label("unpublished"),
            func.count().filter(o.c.attempts > 0).label("retrying"),
            func.max(db_age(o.c.created_at)).label("oldest_age_seconds"),
        ).where(unsent, ~hook)
    ).one()
    dead = conn.execute(select(func.count()).where(_dead_or_parked(o, False))).scalar_one()
    kept, has_error = or_(unsent, o.c.dead_at.is_not(None)), o.c.last_error.is_not(None)
    counts = (unsent, and_(unsent, o.c.attempts > 0), _dead_or_parked(o, False))
    grouped = select(o.c.exchange, *(func.count().filter(c) for c in counts)).where(hook, kept)
    webhooks = []
    for name, *numbers in conn.execute(grouped.group_by(o.c.exchange).order_by(o.c.exchange)):
        errors = select(o.c.last_error).where(o.c.exchange == name, kept, has_error)
        error = conn.execute(errors.order_by(o.c.id.desc()).limit(1)).scalar()
        values = (name.removeprefix(WEBHOOK), *numbers, error)
        webhooks.append(dict(zip(WEBHOOK_FIELDS, values, strict=True)))
    return {
        "unpublished": int(row.unpublished),
        "retrying": int(row.retrying),
        "oldest_age_seconds": _float(row.oldest_age_seconds),
        "dead": int(dead),
        "webhooks": webhooks,
    }


#: The tenants `inbox_status` lists: those with the most rows waiting.
TOP_TENANTS = 10


def inbox_status(conn: Connection, tables: Tables) -> dict[str, Any]:
    """Inbox rows by state (docs/cli.md, "status"), the age of the oldest pending row, and the
    counts per type, with the type's caps (``cap``: ``max_concurrency``; ``rate``: ``[n, seconds]``)
    and whether one holds back work now. ``claimable`` rows are those a worker's claim would take
    now (due, not leased, not held behind an earlier row of their key);
    ``oldest_claimable_age_seconds`` is how long the longest-waiting of them has been claimable
    (since its retry came due or its lease ran out); ``last_handled_age_seconds`` the age of the
    newest processed or dead row's ``processed_at`` (None without one). ``tenants_waiting``: the
    tenants with pending rows; ``by_tenant``: the `TOP_TENANTS` of them with the most rows waiting.
    """
    i = tables.inbox
    claimable_since = case(
        (i.c.locked_until > i.c.next_attempt_at, i.c.locked_until), else_=i.c.next_attempt_at
    )
    since = func.max(db_age(claimable_since)).label("oldest")
    stmt = select(func.count().label("claimable"), since).where(claimable(i, liveness=False))
    ready = conn.execute(stmt).one()
    # Each statement reads the partial indexes of its rows, never every finished row: the newest
    # processed_at of the processed rows (one index entry per partition) and of the dead ones;
    # the pending and dead rows through their indexes (an OR, which the planner splits over
    # both, where IN would read the table); the processed rows counted on their narrow index.
    newest = select(db_age(func.max(i.c.processed_at)))
    handled = [conn.execute(newest.where(i.c.status == s)).scalar_one() for s in (PROCESSED, DEAD)]
    last_handled = min((age for age in handled if age is not None), default=None)
    leased = and_(i.c.status == PENDING, i.c.locked_until > db_now())
    waiting = and_(
        i.c.status == PENDING, or_(i.c.locked_until.is_(None), i.c.locked_until <= db_now())
    )
    unfinished = or_(i.c.status == PENDING, i.c.status == DEAD)
    counts = (
        func.count().filter(waiting).label("pending"),
        func.count().filter(leased).label("in_progress"),
        func.count().filter(i.c.status == DEAD).label("dead"),
    )
    oldest = func.max(db_age(i.c.received_at)).filter(i.c.status == PENDING).label("oldest")
    totals = conn.execute(select(*counts, oldest).where(unfinished)).one()
    processed = conn.execute(select(func.count()).where(i.c.status == PROCESSED)).scalar_one()
    caps: dict[str, dict[str, Any]] = {"cap": {}, "rate": {}}  # as `Handlers.advertised`
    for handlers in conn.execute(select(tables.instances.c.handlers)).scalars():
        for h in handlers or ():
            for name, found in caps.items():
                if h.get(name) is not None:
                    found[h["pattern"]] = min(h[name], found.get(h["pattern"], h[name]))
    left = places_left(conn, tables, caps["cap"], caps["rate"])
    by_type = select(i.c.routing_key, *counts).where(unfinished).group_by(i.c.routing_key)
    per_type = conn.execute(by_type.order_by(i.c.routing_key)).all()
    pending_tenants = select(i.c.tenant, *counts[:2]).where(i.c.status == PENDING, i.c.tenant != "")
    tenants = pending_tenants.group_by(i.c.tenant).subquery("tenants")
    most = select(tenants, func.count().over().label("waiting")).limit(TOP_TENANTS)
    per_tenant = conn.execute(most.order_by(tenants.c.pending.desc(), tenants.c.tenant)).all()
    return {
        "pending": int(totals.pending),
        "in_progress": int(totals.in_progress),
        "dead": int(totals.dead),
        "processed": int(processed),
        "oldest_pending_age_seconds": _float(totals.oldest),
        "claimable": int(ready.claimable),
        "oldest_claimable_age_seconds": _float(ready.oldest),
        "last_handled_age_seconds": _float(last_handled),
        "by_type": [
            {
                "type": r.routing_key,
                "pending": int(r.pending),
                "in_progress": int(r.in_progress),
                "dead": int(r.dead),
                "cap": caps["cap"].get(r.routing_key),
                "rate": caps["rate"].get(r.routing_key),
                # Work waits that a cap holds back now: a claim would find no place.
                "cap_binding": r.pending > 0 and left.get(r.routing_key, 1) <= 0,
            }
            for r in per_type
        ],
        "tenants_waiting": per_tenant[0].waiting if per_tenant else 0,
        "by_tenant": [
            {"tenant": r.tenant, "pending": int(r.pending), "in_progress": int(r.in_progress)}
            for r in per_tenant
        ],
    }


def tenant_backlogs(conn: Connection, tenants: Sequence[tuple[str, Tables]]) -> list[RowMapping]:
    """Of each (tenant, its tables in this database) of `tenants`, in one UNION ALL: ``tenant``,
    ``outbox`` (rows unsent), ``inbox`` (rows pending), ``lag_seconds`` (the oldest's age; 0).
    Each table is read once (its count and oldest row together)."""
    parts, greatest = [], func.greatest if is_postgres(conn) else func.max
    for tenant, tables in tenants:
        o, i = tables.outbox, tables.inbox
        waiting = ((o.c.created_at, outbox_unsent(o)), (i.c.received_at, i.c.status == PENDING))
        out, into = (
            select(func.count().label("n"), func.coalesce(func.max(db_age(at)), 0).label("age"))
            .where(where)
            .subquery()
            for at, where in waiting
        )
        lag = greatest(out.c.age, into.c.age).label("lag_seconds")
        named = (out.c.n.label("outbox"), into.c.n.label("inbox"), lag)
        parts.append(select(literal(tenant).label("tenant"), *named).join_from(out, into, true()))
    return list(conn.execute(union_all(*parts)).mappings())


def held_keys(conn: Connection, tables: Tables, limit: int) -> tuple[int, list[RowMapping]]:
    """Ordering keys whose head message (earliest pending row) has failed and waits for a
    retry, holding back the later rows of its key: how many, and up to `limit` of them, most
    messages waiting behind first (key, the head's id, message_id, type, failures,
    next_attempt_at, last_error, ``waiting``)."""
    i = tables.inbox
    keyed = (i.c.status == PENDING, i.c.key.is_not(None))
    heads = (
        select(
            i.c.key,
            i.c.id,
            i.c.message_id,
            i.c.routing_key.label("type"),
            i.c.finished.label("failures"),
            i.c.next_attempt_at,
            i.c.last_error,
        )
        .where(*keyed)
        .order_by(i.c.key, i.c.id)
        .distinct(i.c.key)
        .subquery("heads")
    )
    per_key = select(i.c.key, func.count().label("pending_rows")).where(*keyed).group_by(i.c.key)
    counts = per_key.subquery("counts")
    failing = heads.c.last_error.is_not(None)
    total = conn.execute(select(func.count()).select_from(heads).where(failing)).scalar_one()
    stmt = (
        select(heads, (counts.c.pending_rows - 1).label("waiting"))
        .join_from(heads, counts, heads.c.key == counts.c.key)
        .where(failing)
        .order_by((counts.c.pending_rows - 1).desc(), heads.c.key)
        .limit(limit)
    )
    return int(total), list(conn.execute(stmt).mappings())


def subscriptions_of(conn: Connection, tables: Tables) -> list[RowMapping]:
    """Every recorded subscription: service, exchange, pattern, subscribed_at."""
    s = tables.subscriptions
    return list(conn.execute(select(s).order_by(s.c.service, s.c.exchange, s.c.pattern)).mappings())


def privileges_held(conn: Connection, role: str, wanted: list[tuple[str, str]]) -> list[bool]:
    """Whether `role` holds each (a schema or a qualified table name, privilege) of `wanted`,
    directly or through a role it belongs to (PostgreSQL's ``has_*_privilege``)."""
    has = {True: func.has_table_privilege, False: func.has_schema_privilege}
    return list(conn.execute(select(*[has["." in n](role, n, p) for n, p in wanted])).one())
