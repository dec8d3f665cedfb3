"""The statements of the roles: what the outbox writer, the relay, the receiver, the worker and
the waker run, and what a service sets up on its connections."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    DateTime,
    Engine,
    Float,
    Integer,
    Select,
    String,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    event,
    exists,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    table,
    text,
    true,
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, OID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Dialect, Result, RowMapping
from sqlalchemy.engine.interfaces import Compiled
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

from ..clock import db_age, db_now, db_now_plus
from ..errors import read_only_session
from ..messages import RECEIVED_COLUMNS, RECEIVED_JSON_COLUMNS
from ..tables import DEAD, PENDING, PROCESSED, Tables, outbox_unsent, outbox_webhook

#: Advisory-lock namespaces (the first key of the two-key form). Writers of one ordering key
#: serialize on WRITER_LOCK; a relay holds RELAY_LOCK on each key it is publishing; a worker
#: connection holds WORKER_LOCK on its claimant name for as long as it lives (its liveness); a
#: receiver holds INBOX_LOCK on each message id it is storing, until it commits; a claim of
#: capped types holds CAP_LOCK on each of them, until it commits.
WRITER_LOCK = 0x0B0C
RELAY_LOCK = 0x0B0D
WORKER_LOCK = 0x0B0E
INBOX_LOCK = 0x0B0F
#: The lead of a wake-up channel: held, on its LISTEN session, by the one waker of the channel
#: that listens on it (see `waker.Waker`).
LEAD_LOCK = 0x0B10
CAP_LOCK = 0x0B11
#: Ends the claimant name of a worker that holds no liveness lock (behind a pooler in
#: transaction mode without ``listen_url``): its rows are free only when their lease ends.
LEASE_ONLY = "+lease-only"
#: How long a row a worker left to others (`release_claims` with ``away``) waits: it is due to
#: every other worker after `AWAY`, and to the worker that left it after twice that.
AWAY = timedelta(seconds=1)

# The server's lock table, read by claims to tell a live claimant from a dead one.
_pg_locks = table(
    "pg_locks",
    column("locktype"),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid"),
    column("granted"),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid"), column("datname"), schema="pg_catalog")

Executor = Session | Connection


def _insert(conn: Connection, table: Any) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT (PostgreSQL and SQLite both do)."""
    return sqlite_insert(table) if conn.dialect.name == "sqlite" else pg_insert(table)


def is_postgres(executor: Executor) -> bool:
    """Whether `executor` runs on PostgreSQL (else SQLite)."""
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    return bind.dialect.name == "postgresql"


# --- outbox and relay -----------------------------------------------------------------------------


def insert_outbox(executor: Executor, tables: Tables, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert outbox rows in the caller's transaction. Each row gives ``ttl`` and ``delay`` in
    seconds (or None) instead of times: the database computes ``expires_at`` and ``available_at``
    from its own clock, so a writer whose host clock is wrong cannot expire or delay a message by
    mistake. A row may carry its payload already encoded as JSON text in ``payload_json`` (the
    outbox encodes it to check its size): it is sent as it is. On PostgreSQL the writer first takes
    a transaction-scoped advisory lock on each ordering key, so two transactions writing the same
    key take their ids one after the other: id order is commit order for a key, which is the order
    the relay publishes it in."""
    # The Session's connection: a Core statement runs there as Session.execute would run it
    # (no autoflush), without the ORM's execution layer, on the hot path of every writer.
    conn = executor.connection() if isinstance(executor, Session) else executor
    postgres = conn.dialect.name == "postgresql"
    keys = sorted({row["key"] for row in rows if row.get("key") is not None})
    if keys and postgres:
        for key in keys:  # sorted: two writers of several keys lock them in one order
            conn.execute(
                select(func.pg_advisory_xact_lock(WRITER_LOCK, func.hashtext(bindparam("k")))),
                {"k": key},
            )
    if not postgres:  # SQLAlchemy's JSON type encodes the payload
        params = [{k: v for k, v in row.items() if k != "payload_json"} for row in rows]
        conn.execute(_insert_outbox_statement(tables, False), params)
        return
    # On the connection's DB-API cursor, with the statement compiled once: every writer pays
    # this per message, and SQLAlchemy's execution layer cost more than the INSERT itself
    # (bench/README.md, figure w). SQLAlchemy's cursor events do not see this statement.
    if not conn.in_transaction():
        conn.begin()  # as executing a statement would (autobegin): the caller commits it
    cursor = _outbox_cursor(conn)
    try:
        for row in rows:
            values = _outbox_params(row)
            # The compiled text's parameters are the row's keys by name (a unit test says so).
            sql_text = _insert_outbox_compiled(tables, conn.dialect, tuple(values)).string
            cursor.execute(sql_text, values)
    except conn.dialect.loaded_dbapi.Error as exc:
        # Past SQLAlchemy's execution, its invalidation is done here: a lost connection, or a
        # session on a standby (database.read_only_drops_the_pool), which the pool's ping
        # would keep for good, leaves the pool, and the caller's next transaction reconnects.
        dbapi = conn.connection.dbapi_connection
        gone = read_only_session(exc) or conn.dialect.is_disconnect(exc, dbapi, cursor)
        if gone:
            conn.invalidate(exc)
        raise DBAPIError.instance(
            "INSERT INTO outbox_messages",
            None,
            exc,
            conn.dialect.loaded_dbapi.Error,
            connection_invalidated=gone,
        ) from exc


def _outbox_cursor(conn: Connection) -> Any:
    """A DB-API cursor of `conn`'s database connection, kept for the outbox's inserts in the
    connection's ``info`` (which lives as long as the pooled connection): made once per
    database connection, not per message."""
    dbapi_connection = conn.connection.dbapi_connection
    kept = conn.connection.info.get("outbox_inbox.cursor")
    if kept is None or kept[0] is not dbapi_connection:
        kept = (dbapi_connection, dbapi_connection.cursor())  # type: ignore[union-attr]
        conn.connection.info["outbox_inbox.cursor"] = kept
    return kept[1]


@cache
def _insert_outbox_compiled(tables: Tables, dialect: Dialect, keys: tuple[str, ...]) -> Compiled:
    """`_insert_outbox_statement` compiled for `dialect` with the parameters `keys`."""
    statement = _insert_outbox_statement(tables, True)
    compiled: Compiled = statement.compile(dialect=dialect, column_keys=list(keys))
    return compiled


def _outbox_params(row: Mapping[str, Any]) -> dict[str, Any]:
    """`row` with its payload and headers as JSON text, for `_insert_outbox_statement`."""
    params = dict(row)
    payload = params.pop("payload")
    encoded = params.pop("payload_json", None)
    params["payload"] = _JSON_TEXT(payload) if encoded is None else encoded
    params["headers"] = _JSON_TEXT(params["headers"])
    return params


@cache
def _insert_outbox_statement(tables: Tables, postgres: bool) -> Any:
    ttl, delay = bindparam("ttl", type_=Float), bindparam("delay", type_=Float)
    # The casts give PostgreSQL the parameters' type where they stand alone (IS NULL).
    values: dict[str, Any] = {
        "expires_at": case((cast(ttl, Float).is_(None), null()), else_=db_now_plus(ttl)),
        "available_at": case((cast(delay, Float).is_(None), db_now()), else_=db_now_plus(delay)),
    }
    if postgres:  # JSON text, cast by the server: encoded once, by the outbox
        for name in ("payload", "headers"):
            values[name] = cast(bindparam(name, type_=Text), JSONB)
    # inline(): no RETURNING of the new id, which nobody reads.
    return tables.outbox.insert().values(**values).inline()


def insert_payload(executor: Executor, tables: Tables, key: str, data: bytes) -> None:
    """Store a payload sent by reference (the claim check) in the caller's transaction."""
    executor.execute(insert(tables.payloads).values(key=key, data=data))


def read_payload(conn: Connection, tables: Tables, key: str) -> bytes | None:
    """The payload stored under `key`, or None."""
    p = tables.payloads
    return conn.execute(select(p.c.data).where(p.c.key == key)).scalar()


#: A claimed row (outbox or inbox): its columns by name.
Claimed = dict[str, Any]


def _dicts(result: Result[Any]) -> list[Claimed]:
    """The rows of `result` as plain dicts: a role reads each claimed row's columns many
    times, which a RowMapping answers in Python, a dict in C."""
    names = tuple(result.keys())
    return [dict(zip(names, row, strict=True)) for row in result.all()]


def claim_outbox(conn: Connection, tables: Tables, limit: int) -> list[Claimed]:
    """Lock up to `limit` publishable rows in id order (``FOR UPDATE SKIP LOCKED``), until the
    transaction ends, with the columns a relay publishes from (`_relayed_columns`) and
    ``claimed_at``, the database's time of the claim. A keyed row qualifies only while no earlier
    row of its key waits for a retry, and only if this transaction gets the relay's advisory lock on
    the key (another relay may be publishing its earlier rows). The lock is tried row by row during
    the scan, so another relay may release a key half-way through it: the caller must check the
    claimed rows of each key against `earliest_unsent` and leave them alone unless they start there.
    """
    stmt = _claim_outbox_statement(tables, is_postgres(conn))
    return _dicts(conn.execute(stmt, {"limit": limit}))


@cache
def _claim_outbox_statement(tables: Tables, postgres: bool) -> Any:
    """The claim of `claim_outbox`, built once per schema (the relay runs it for every batch)."""
    o = tables.outbox
    earlier = o.alias("earlier")
    held_back = exists().where(
        earlier.c.key == o.c.key,
        outbox_unsent(earlier),
        earlier.c.id < o.c.id,
        earlier.c.available_at > db_now(),
    )
    key_free: Any = ~held_back
    if postgres:
        # SQLite has no such locks and needs none: its transactions take the database's write
        # lock at BEGIN (see outbox_inbox.database), so one claim runs at a time.
        key_free = and_(
            key_free, func.pg_try_advisory_xact_lock(RELAY_LOCK, func.hashtext(o.c.key))
        )
    return (
        select(*_relayed_columns(tables, postgres), db_now().label("claimed_at"))
        .where(
            outbox_unsent(o),
            o.c.available_at <= db_now(),
            or_(o.c.key.is_(None), key_free),
            ~outbox_webhook(o),
        )
        .order_by(o.c.id)
        .limit(bindparam("limit", type_=Integer, literal_execute=True))
        .with_for_update(skip_locked=True, of=o)
    )


def claim_webhooks(
    conn: Connection, tables: Tables, exchange: str, limit: int, lease: float
) -> list[RowMapping]:
    """Take the `limit` delivery rows of one webhook endpoint (`exchange`) due the longest for
    `lease` seconds, returned in id order; the caller commits before it sends them."""
    params = {"endpoint": exchange, "limit": limit, "lease": lease}
    rows = conn.execute(_claim_webhooks_statement(tables), params).mappings()
    return sorted(rows, key=lambda row: row["id"])


@cache
def _claim_webhooks_statement(tables: Tables) -> Any:
    """`claim_webhooks`'s statement, built once: the role runs it at every step."""
    o = tables.outbox
    due = (
        select(o.c.id)
        .where(outbox_unsent(o), outbox_webhook(o), o.c.available_at <= db_now())
        .where(o.c.exchange == bindparam("endpoint", type_=String))
        .order_by(o.c.available_at, o.c.id)
        .limit(bindparam("limit", type_=Integer, literal_execute=True))
        .with_for_update(skip_locked=True)
    )
    taken = update(o).where(o.c.id.in_(due.scalar_subquery()))
    return taken.values(available_at=db_now_plus(bindparam("lease", type_=Float))).returning(*o.c)


def release_webhooks(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Make claimed delivery rows due at once again, no attempt counted (not sent)."""
    if ids:
        conn.execute(
            _mark_outbox_statement(tables, is_postgres(conn), "available_at"), {"ids": ids}
        )


#: The outbox columns a relay does not publish from.
_UNRELAYED = ("available_at", "published_at", "expired_at", "last_error", "dead_at", "dead_reason")


def _relayed_columns(tables: Tables, postgres: bool) -> list[Any]:
    """The outbox columns a relay publishes from."""
    o = tables.outbox
    relayed: list[Any] = [c for c in o.c if c.name not in _UNRELAYED]
    if postgres:
        # Most rows have no headers of their own: NULL for those spares decoding a `{}`.
        empty = cast(literal("{}"), JSONB)
        headers = case((o.c.headers == empty, null()), else_=o.c.headers)
        relayed = [
            type_coerce(headers, o.c.headers.type).label("headers") if c.name == "headers" else c
            for c in relayed
        ]
    return relayed


def claimed_outbox_rows(conn: Connection, tables: Tables, ids: Sequence[int]) -> dict[int, Claimed]:
    """The rows of `ids` as `claim_outbox` returns them, by id: rows this transaction claimed."""
    if not ids:
        return {}
    postgres = is_postgres(conn)
    o = tables.outbox
    stmt = select(*_relayed_columns(tables, postgres)).where(_among(o.c.id, postgres))
    return {row["id"]: row for row in _dicts(conn.execute(stmt, {"ids": list(ids)}))}


def earliest_unsent(conn: Connection, tables: Tables, keys: Sequence[str]) -> dict[str, int]:
    """The id of the earliest row still to be published, for each of `keys`. Run after
    `claim_outbox`, in its transaction (a new statement, so a new snapshot): a relay that claimed a
    key's rows publishes them only if they start at this row."""
    if not keys:
        return {}
    stmt = _earliest_unsent_statement(tables, is_postgres(conn))
    return {key: int(first) for key, first in conn.execute(stmt, {"keys": list(keys)}).all()}


@cache
def _earliest_unsent_statement(tables: Tables, postgres: bool) -> Any:
    o = tables.outbox
    among = _among(o.c.key, postgres, "keys", String)
    return select(o.c.key, func.min(o.c.id)).where(outbox_unsent(o), among).group_by(o.c.key)


def mark_published(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Set published_at on confirmed rows."""
    if ids:
        stmt = _mark_outbox_statement(tables, is_postgres(conn), "published_at")
        conn.execute(stmt, {"ids": list(ids)})


def mark_expired(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Set expired_at on rows whose time to live ran out before they were published."""
    if ids:
        stmt = _mark_outbox_statement(tables, is_postgres(conn), "expired_at")
        conn.execute(stmt, {"ids": list(ids)})


@cache
def _mark_outbox_statement(tables: Tables, postgres: bool, column_name: str) -> Any:
    o = tables.outbox
    return update(o).where(_among(o.c.id, postgres)).values({column_name: db_now()})


def mark_publish_failed(
    conn: Connection, tables: Tables, ids: Sequence[int], error: str, delay: timedelta
) -> None:
    """Count a failed attempt on rows that stay unpublished, and hold them back for `delay`."""
    if ids:
        stmt = _outbox_failed_statement(tables, is_postgres(conn), dead=False)
        params = {"ids": list(ids), "error": error[:2000], "delay": delay.total_seconds()}
        conn.execute(stmt, params)


def mark_outbox_dead(
    conn: Connection,
    tables: Tables,
    ids: Sequence[int],
    reason: str,
    error: str,
    *,
    fingerprint: str | None = None,
) -> None:
    """Count a last failed attempt on rows and take them out of the relay's way as dead,
    with the `fingerprint` of why (default: the reason)."""
    if ids:
        stmt = _outbox_failed_statement(tables, is_postgres(conn), dead=True)
        params = {"ids": list(ids), "reason": reason[:255], "error": error[:2000]}
        conn.execute(stmt, {**params, "fingerprint": (fingerprint or reason)[:255]})


@cache
def _outbox_failed_statement(tables: Tables, postgres: bool, *, dead: bool) -> Any:
    """A failed attempt counted on the rows of ``ids``, with its ``error``: held back for
    ``delay`` seconds, or (`dead`) dead for ``reason`` with its ``fingerprint``."""
    o = tables.outbox
    values: dict[str, Any] = {
        "attempts": o.c.attempts + 1,
        "last_error": bindparam("error", type_=String),
    }
    if dead:
        values.update(
            dead_reason=bindparam("reason", type_=String),
            fingerprint=bindparam("fingerprint", type_=String),
            dead_at=db_now(),
        )
    else:
        values["available_at"] = db_now_plus(bindparam("delay", type_=Float))
    return update(o).where(_among(o.c.id, postgres)).values(**values)


# --- receiver and worker --------------------------------------------------------------------------


def insert_inbox(
    conn: Connection, tables: Tables, rows: Sequence[Mapping[str, Any]], *, bound: bool = False
) -> set[uuid.UUID]:
    """Store received messages once each: a message_id already stored is skipped. Returns the
    message ids of the rows that were new. On PostgreSQL the inbox is partitioned by time, and a
    unique index holds in one partition only: two copies received at two times would not collide. So
    the receiver first takes a transaction-level advisory lock on each message id (in one order, so
    that two receivers never deadlock), then inserts only the ids no partition holds yet: a second
    copy being stored at the same moment waits for the first one's commit, and its insert, a new
    statement, sees that row. `bound`: with `bound_on_server`, in the locks' round trip."""
    if not rows:
        return set()
    if conn.dialect.name == "postgresql":
        # The whole batch as one JSON document, read back by the server into typed columns:
        # the statement's text never changes, and no value is adapted one by one (a text
        # array of JSON documents cost psycopg a regular expression per quote).
        batch = _BATCH_JSON([{name: row[name] for name in RECEIVED_COLUMNS} for row in rows])
        conn.execute(_locking_ids(bound), {"keys": [str(row["message_id"]) for row in rows]})
        sql_text = _insert_inbox_sql(tables, conn.dialect)
        result = conn.exec_driver_sql(sql_text, {"rows": batch})
        return {message_id for (message_id,) in result.all()}
    stmt = (
        _insert(conn, tables.inbox)
        .on_conflict_do_nothing(index_elements=["message_id"])
        .returning(tables.inbox.c.message_id)
    )
    return {message_id for (message_id,) in conn.execute(stmt, list(rows)).all()}


#: JSON text as SQLAlchemy's JSON type writes it (`json.dumps`; None is JSON null).
_JSON_TEXT = json.JSONEncoder().encode


def _json_default(value: Any) -> str:
    """UUIDs and times, the values of an inbox row that JSON has no type for."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not a column value of the inbox")


_BATCH_JSON = json.JSONEncoder(default=_json_default, ensure_ascii=False).encode


@cache
def _insert_inbox_sql(tables: Tables, dialect: Dialect) -> str:
    """`_insert_inbox_statement` compiled once: SQLAlchemy caches no PostgreSQL ``INSERT … ON
    CONFLICT`` (its construct opts out of the statement cache), and compiling this one cost
    the receiver 1.4 ms of CPU per batch, more than storing a lone message."""
    return str(_insert_inbox_statement(tables).compile(dialect=dialect))


def _insert_inbox_statement(tables: Tables) -> Any:
    """``INSERT … SELECT … FROM jsonb_to_recordset(:rows) AS received(message_id UUID, …)
    ON CONFLICT DO NOTHING RETURNING message_id``: a batch as one JSON array (PostgreSQL). The
    stored ids: ``NOT EXISTS (… OFFSET 0)``, an index probe per row, never a join (planned on an
    empty inbox and kept, a join read the whole index of ids at each insert once it filled)."""
    inbox = tables.inbox
    received = (
        func.jsonb_to_recordset(cast(bindparam("rows", type_=Text), JSONB))
        .table_valued(*(column(name, inbox.c[name].type) for name in RECEIVED_COLUMNS))
        .render_derived(name="received", with_types=True)
    )
    # A JSON null in the document is SQL NULL in the record: the payload may be JSON null.
    json_null = literal_column("'null'::jsonb", JSONB)
    coalesced = {n: func.coalesce(received.c[n], json_null) for n in RECEIVED_JSON_COLUMNS}
    values = [coalesced.get(n, received.c[n]) for n in RECEIVED_COLUMNS]
    probe = select(1).where(inbox.c.message_id == received.c.message_id)
    stored = exists(probe.offset(literal_column("0")))
    return (
        pg_insert(inbox)
        .from_select(list(RECEIVED_COLUMNS), select(*values).where(~stored))
        .on_conflict_do_nothing()  # the unique index of the row's partition, belt and braces
        .returning(inbox.c.message_id)
    )


@cache
def _locking_ids(bound: bool) -> Select[Any]:
    """The locks on a batch's message ids; `bound`: after `bound_on_server`'s settings."""
    bounds = _tcp_bounds(local=True, user_timeout=True) if bound else select()
    return bounds.add_columns(_xact_locks(INBOX_LOCK))


_XACT_LOCKS = text(
    "SELECT count(pg_advisory_xact_lock(:namespace, h)) FROM (SELECT DISTINCT hashtext(k) AS h"
    " FROM unnest(CAST(:keys AS text[])) AS k ORDER BY h) AS locked"
).columns(column("n", Integer))


def _xact_locks(namespace: int) -> Any:
    """Transaction locks in `namespace` on the texts ``:keys``, in hash order, as a scalar."""
    return _XACT_LOCKS.bindparams(namespace=namespace).scalar_subquery()


def is_stored(conn: Connection, tables: Tables, message_id: uuid.UUID) -> bool:
    """Whether the inbox holds `message_id`."""
    i = tables.inbox
    return conn.execute(select(i.c.id).where(i.c.message_id == message_id)).first() is not None


def count_duplicates(conn: Connection, tables: Tables, counts: Mapping[uuid.UUID, int]) -> None:
    """Add deliveries dropped as already stored to each message id's duplicate counter."""
    if not counts:
        return
    d = tables.deliveries
    insert = _insert(conn, d).values(
        [{"message_id": m, "duplicates": n} for m, n in sorted(counts.items())]
    )
    conn.execute(
        insert.on_conflict_do_update(
            index_elements=[d.c.message_id],
            set_={"duplicates": d.c.duplicates + insert.excluded.duplicates},
        )
    )


def count_deliveries(
    conn: Connection, tables: Tables, message_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, int]:
    """Add one delivery to each message id (upsert) and return the new counts."""
    if not message_ids:
        return {}
    d = tables.deliveries
    insert = _insert(conn, d).values([{"message_id": m, "deliveries": 1} for m in message_ids])
    stmt = insert.on_conflict_do_update(
        index_elements=[d.c.message_id],
        set_={"deliveries": d.c.deliveries + 1, "last_seen_at": db_now()},
    ).returning(d.c.message_id, d.c.deliveries)
    return {m: int(n) for m, n in conn.execute(stmt).all()}


#: The columns a claim returns: what the worker needs to build the message and decide its
#: fate. (``last_error`` can be large and is kept by ``mark_dead`` unless replaced.)
_CLAIMED = ("id", *RECEIVED_COLUMNS, "received_at", "attempts", "finished")


def claim_inbox(
    conn: Connection,
    tables: Tables,
    worker: str,
    limit: int,
    lease: timedelta,
    *,
    fair: bool = True,
    after: tuple[str, str] | None = None,
    caps: Mapping[str, int] | None = None,
    rates: Mapping[str, tuple[int, float]] | None = None,
    weights: Mapping[str, int] | None = None,
    tenant_weights: Mapping[str, int] | None = None,
    flush_wait: bool = True,
) -> list[Claimed]:
    """Lease up to `limit` due pending rows to `worker`; count the claim in `attempts`.

    The rules are those of docs/concepts.md ("Fair claims and caps", "Ordering keys"): highest
    priority first; with `fair`, the groups (routing key and tenant) in turn, weighted by
    `weights` and `tenant_weights`, from the group after `after` (the last one this worker was
    served); `caps` (``max_concurrency``; a claim takes at most half, rounded up, of the places
    left, so they go to several workers) and `rates` (``(n, seconds)``) by routing key, the
    rows held back neither leased nor counted. A keyed row qualifies only when no earlier
    pending row has its key; a leased row once its lease ran out on the database clock or, on
    PostgreSQL, once its claimant no longer holds its liveness lock (`hold_claimant_lock`).

    On PostgreSQL a claim of capped types holds a transaction lock per type (`CAP_LOCK`) until
    the caller's transaction ends (keep it short), and the rest of that transaction runs with
    the settings of `_CLAIM_SETTINGS` (`flush_wait`): run the claim last in its transaction. It
    commits with the caller's transaction, so the count survives a crash of the handler. The
    rows come in the order they were served (`served_order`; without `fair`, by priority then
    arrival), each with the `_CLAIMED` columns and ``claimed_at``, the database's time."""
    postgres = conn.dialect.name == "postgresql"
    caps, rates = caps or {}, rates or {}
    capped = tuple((k, caps.get(k), rates.get(k)) for k in sorted({*caps, *rates}))
    weighted = tuple(sorted((weights or {}).items())) if fair else ()
    tenants = tuple(sorted((tenant_weights or {}).items())) if fair else ()
    if postgres:  # the settings, and the capped types' locks: one round trip
        conn.execute(_CLAIM_SETTINGS[flush_wait, bool(capped)], {"keys": [k for k, *_ in capped]})
    params = {"claimant": worker, "limit": limit, "lease": lease.total_seconds()}
    if fair or capped:
        stmt = _fair_claim_statement(tables, postgres, fair, capped, weighted, tenants)
        if fair:
            params["after"], params["after_tenant"] = after or ("", "")
    else:
        stmt = _claim_statement(tables, postgres)
    rows = _dicts(conn.execute(stmt, params))
    rows.sort(key=lambda r: (-r["priority"], r["id"]))
    rated = Counter(row["routing_key"] for row in rows if row["routing_key"] in rates)
    for key, n in sorted(rated.items()):
        _count_rate(conn, tables, key, n, rates[key][1], rows[0]["claimed_at"])
    return served_order(rows, after or ("", ""), dict(weighted), dict(tenants)) if fair else rows


def _count_rate(
    conn: Connection, tables: Tables, key: str, n: int, seconds: float, at: datetime
) -> None:
    """Add `n` rows claimed of the rate-capped `key` at `at` (the database clock) to the tenth
    of its period they fall in. Under the type's lock no other claim writes its counts; a
    tenth's first claim drops the tenths that ended before the period it can see."""
    add, drop, start = _rate_statements(tables)
    width = _tenth_ms(seconds)
    tenth = int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() * 1000) // width * width
    params = {"key": key, "tenth": tenth, "n": n}
    if conn.execute(add, params).rowcount == 0:
        conn.execute(drop, {"key": key, "gone": tenth - seconds * 1000 - width})
        conn.execute(start, params)


@cache
def _rate_statements(tables: Tables) -> tuple[Any, Any, Any]:
    """`_count_rate`'s statements, built once: built at each claim, they cost it 0.1 ms."""
    rc = tables.rate_counts
    key, tenth = bindparam("key", type_=String), bindparam("tenth", type_=BigInteger)
    n = bindparam("n", type_=Integer)
    add = update(rc).where(rc.c.routing_key == key, rc.c.bucket == tenth)
    drop = delete(rc).where(rc.c.routing_key == key, rc.c.bucket <= bindparam("gone"))
    start = rc.insert().values(routing_key=key, bucket=tenth, claimed=n)
    return add.values(claimed=rc.c.claimed + n), drop, start


def _tenth_ms(seconds: float) -> int:
    """The span a rate of period `seconds` is counted in: a tenth of it, in milliseconds."""
    return max(1, round(seconds * 100))


def served_order(
    rows: list[Claimed],
    after: tuple[str, str],
    weights: Mapping[str, int] | None = None,
    tenant_weights: Mapping[str, int] | None = None,
) -> list[Claimed]:
    """`rows` (by priority, then id) in the order a fair claim with `after` and the weights
    served them: by priority, then in rounds (each group's first `weight` rows, then its
    next…), in a round the groups (routing key, tenant) after `after` first, then arrival."""
    if len({(row["routing_key"], row["tenant"]) for row in rows}) < 2:
        return rows  # one group's turns follow its arrival order
    turns: Counter[tuple[int, tuple[str, str]]] = Counter()
    served = []
    for row in rows:
        group = (row["routing_key"], row["tenant"])
        w = (weights or {}).get(group[0], 1) * (tenant_weights or {}).get(group[1], 1)
        turns[row["priority"], group] += 1
        turn = (turns[row["priority"], group] + w - 1) // w
        served.append((-row["priority"], turn, group <= after, row["id"], row))
    return [entry[-1] for entry in sorted(served, key=lambda e: e[:4])]


def places_left(
    conn: Connection, tables: Tables, caps: Mapping[str, int], rates: Mapping[str, Any]
) -> dict[str, int]:
    """The places a claim would find left now under the `caps` and `rates` of each capped
    routing key (`claim_inbox`); 0 or less while a cap holds back work."""
    capped = tuple((k, caps.get(k), rates.get(k)) for k in sorted({*caps, *rates}))
    left = _cap_of(tables, bindparam("k", type_=String), capped, liveness=is_postgres(conn))
    return {key: conn.execute(select(left), {"k": key}).scalar_one() for key, _, _ in capped}


@cache
def _claim_statement(tables: Tables, liveness: bool) -> Any:
    """The FIFO claim of `claim_inbox`, built once per schema (a worker runs it every batch)."""
    i = tables.inbox
    due = (
        select(i.c.id)
        .where(claimable(i, liveness=liveness, claimant=True))
        .order_by(i.c.priority.desc(), i.c.id)
        .limit(bindparam("limit", type_=Integer, literal_execute=True))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return _lease(tables, due, liveness)


def _lease(tables: Tables, ids: Any, postgres: bool) -> Any:
    """The UPDATE that leases the rows of the subquery `ids` and counts the claim. With
    `postgres`, the ids are taken as an array (an init plan): the rows are then found by id,
    never by a hash join over the inbox the planner may choose for ``IN``."""
    i = tables.inbox
    found = i.c.id == any_(func.array(ids)) if postgres else i.c.id.in_(ids)
    return (
        update(i)
        .where(found)
        .values(
            locked_until=db_now_plus(bindparam("lease", type_=Float)),
            locked_by=bindparam("claimant", type_=String),
            attempts=i.c.attempts + 1,
        )
        .returning(*(i.c[name] for name in _CLAIMED), db_now().label("claimed_at"))
    )


@cache
def _fair_claim_statement(
    tables: Tables,
    postgres: bool,
    fair: bool,
    caps: tuple[_Cap, ...],
    weights: tuple[tuple[str, int], ...] = (),
    tenant_weights: tuple[tuple[str, int], ...] = (),
) -> Any:
    """The claim of `claim_inbox` with `caps`, in rounds of the weights (`fair`) or arrival
    order, built once per schema, caps and weights. On PostgreSQL the groups waiting are read
    from the index of pending rows, one probe per group (a recursive scan), then each group's
    first `limit` claimable rows (a lateral subquery that row-locks them, SKIP LOCKED); SQLite
    numbers every claimable row instead. The first `limit` in served order are leased."""
    i = tables.inbox
    limit = bindparam("limit", type_=Integer, literal_execute=True)
    if postgres:
        probe = i.alias("probe")

        # From the newest end: a drain's handled rows, in the index until a vacuum, lie at the
        # other. LIMIT 1 written into the text: as a parameter, the generic plan of the prepared
        # claim would expect a tenth of the table from each probe, and each run be planned anew.
        def newest(*where: Any) -> Select[Any]:
            return (
                select(probe.c.routing_key.label("rk"), probe.c.tenant)
                .where(probe.c.status == _inline(PENDING), *where)
                .order_by(probe.c.routing_key.desc(), probe.c.tenant.desc())
                .limit(_inline(1))
            )

        groups = select(newest().subquery("first")).cte("groups", recursive=True)
        below = tuple_(probe.c.routing_key, probe.c.tenant) < tuple_(groups.c.rk, groups.c.tenant)
        later = newest(below).lateral("later")
        groups = groups.union_all(select(later).select_from(groups.join(later, true())))
        places = _cap_of(tables, groups.c.rk, caps, liveness=True)
        take: Any = limit
        if places is not None:  # counted once per group (not inlined)
            groups = select(groups, places.label("places")).cte("caps").prefix_with("MATERIALIZED")
            take = func.greatest(0, func.least(limit, func.coalesce(groups.c.places, limit)))
        heads = (
            select(i.c.id, i.c.priority, i.c.routing_key, i.c.tenant)
            .where(
                claimable(i, liveness=True, claimant=True),
                i.c.routing_key == groups.c.rk,
                i.c.tenant == groups.c.tenant,
            )
            # The group first, though it is one: the order of the index, read alone.
            .order_by(i.c.routing_key, i.c.tenant, i.c.priority.desc(), i.c.id)
            .limit(take)
            .with_for_update(skip_locked=True)
            .lateral("heads")
        )
        cap = [groups.c.places] if places is not None else []
        source = select(heads, *cap).select_from(groups.join(heads, true())).subquery("source")
    else:
        places = _cap_of(tables, i.c.routing_key, caps, liveness=False)
        cap = [places.label("places")] if places is not None else []
        source = (
            select(i.c.id, i.c.priority, i.c.routing_key, i.c.tenant, *cap)
            .where(claimable(i, liveness=False, claimant=True))
            .subquery("source")
        )
    group = (source.c.routing_key, source.c.tenant)
    turn = func.row_number().over(partition_by=(*group, source.c.priority), order_by=source.c.id)
    r = select(source, turn.label("turn")).subquery("ranked")
    after = tuple_(bindparam("after", type_=String), bindparam("after_tenant", type_=String))

    def served(q: Any) -> tuple[Any, ...]:
        """The order of the rows of `q` within a priority: rounds (a type of weight w gets w
        turns a round: round = ceil(turn / w)), in a round the groups after `after` first."""
        if not fair:
            return (q.c.id,)
        w: Any = literal(1)
        for of, given in ((q.c.routing_key, weights), (q.c.tenant, tenant_weights)):
            if given:
                w = w * case(*((of == key, n) for key, n in given), else_=1)
        rounds = (q.c.turn + w - 1) // w if weights or tenant_weights else q.c.turn
        return (rounds, tuple_(q.c.routing_key, q.c.tenant) <= after, q.c.id)

    if places is not None:  # a capped type's places, to its rows in served order
        order = (r.c.priority.desc(), *served(r))
        nth = func.row_number().over(partition_by=r.c.routing_key, order_by=order)
        r = select(r, nth.label("nth")).subquery("numbered")
    picked = select(r.c.id).order_by(r.c.priority.desc(), *served(r)).limit(limit)
    if places is not None:
        picked = picked.where(r.c.nth <= func.coalesce(r.c.places, r.c.nth))
    return _lease(tables, picked.scalar_subquery(), postgres)


#: A capped routing key, its ``max_concurrency`` and its rate ``(n, seconds)`` (None: none).
_Cap = tuple[str, int | None, tuple[int, float] | None]


def _cap_of(tables: Tables, routing_key: Any, caps: tuple[_Cap, ...], *, liveness: bool) -> Any:
    """The places a claim may take under the caps of `routing_key` (None without caps): of a
    cap, half, rounded up, of those left, its cap less its rows leased now by a live claimant
    (a worker runs its batch one message at a time: taking every place, it would run the type
    alone); of a rate, n less the rows claimed in the tenths of its period that end within its
    last `seconds` (`_count_rate`); of both, the fewer."""
    if not caps:
        return None
    leased, rc = tables.inbox.alias("leased"), tables.rate_counts
    mine = leased.c.routing_key == routing_key, leased.c.status == _inline(PENDING)
    rows = select(leased.c.routing_key).where(*mine, leased.c.locked_until.is_not(None))
    rows = rows.where(~_free(leased, liveness=liveness)).correlate_except(leased)
    in_flight = select(func.count()).select_from(rows.subquery("found")).scalar_subquery()
    # Constants in the text, not parameters: a parameter here kept the server planning the
    # prepared claim anew at each execution (custom plans), 0.4 ms a claim.
    now_ms = db_age(literal_column("'1970-01-01 00:00:00+00:00'")) * 1000
    # Counted in the branch of a capped type only: an uncapped one costs nothing.
    left = []
    for key, n, rate in caps:
        places = None if n is None else (literal(n) - in_flight + 1) // 2
        if rate is not None:
            seen = rc.c.bucket > now_ms - _inline(rate[1] * 1000 + _tenth_ms(rate[1]))
            claimed = select(func.coalesce(func.sum(rc.c.claimed), 0))
            claimed = claimed.where(rc.c.routing_key == routing_key, seen)
            more = _inline(rate[0]) - claimed.scalar_subquery()
            places = more if places is None else case((more < places, more), else_=places)
        left.append((routing_key == key, places))
    return case(*left, else_=None)


def claimable(i: Any, *, liveness: bool, claimant: bool = False) -> ColumnElement[bool]:
    """The rows a claim may take now: pending, due, `_free`, and no earlier pending row of
    its key. With `claimant`, not a row the claim's ``claimant`` left to others within
    `AWAY` of its coming due: polling in step with the delay it set, the worker that left it
    would otherwise be first to take it back every time."""
    earlier = i.alias("earlier")
    mine = []
    if claimant:
        mine.append(
            or_(
                i.c.locked_by.is_(None),
                i.c.locked_until.is_not(None),
                i.c.locked_by != bindparam("claimant", type_=String),
                i.c.next_attempt_at <= db_now_plus(-AWAY),
            )
        )
    return and_(
        *mine,
        i.c.status == _inline(PENDING),
        # Due by the transaction's start: a claim of the next batch, late in a long transaction,
        # must not take at once the rows a worker just left for others (a rolling deploy's
        # "away" rows come due a second later); rows stored meanwhile wait for the next claim.
        i.c.next_attempt_at <= db_now(),
        _free(i, liveness=liveness),
        or_(
            i.c.key.is_(None),
            ~exists().where(
                earlier.c.key == i.c.key,
                earlier.c.status == _inline(PENDING),
                earlier.c.id < i.c.id,
            ),
        ),
    )


def _free(i: Any, *, liveness: bool) -> ColumnElement[bool]:
    """Not leased: its lease ran out, or with `liveness` its claimant holds no liveness lock."""
    free = [i.c.locked_until.is_(None), i.c.locked_until <= db_now()]
    if liveness:
        free.append(
            and_(
                ~i.c.locked_by.endswith(LEASE_ONLY, autoescape=True), _claimant_gone(i.c.locked_by)
            )
        )
    return or_(*free)


def _inline(value: Any) -> Any:
    """`value` written into the statement's text, not sent as a parameter: a statement the
    server prepares then has a generic plan that can use the partial indexes whose predicate
    names that value (``status = 'pending'``). With the value a parameter, PostgreSQL plans the
    statement again at every execution, once per partition of the table."""
    return literal(value, literal_execute=True)


def _claimant_gone(locked_by: Any) -> ColumnElement[bool]:
    """True for a row whose claimant holds no liveness lock in this database (one hashed
    subquery per statement, read only when a leased row is met). Two names with the same hash
    can only make a dead claimant look alive, which the lease still bounds: the safe side."""
    live = select(_pg_locks.c.objid).where(
        _pg_locks.c.locktype == "advisory",
        _pg_locks.c.database
        == select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery(),
        _pg_locks.c.classid == cast(literal(WORKER_LOCK), OID),
        _pg_locks.c.objsubid == 2,
        _pg_locks.c.granted,
    )
    return cast(func.hashtext(locked_by), OID).not_in(live)  # the key `hold_claimant_lock` takes


def hold_claimant_lock(conn: Connection, claimant: str) -> bool:
    """Take the session-level liveness lock of `claimant` on `conn`; False if it is taken.
    A worker that dies, or whose connection is cut, loses it at once, and claims treat its
    leased rows as free. On SQLite (one process, no such locks): nothing, True."""
    if conn.dialect.name != "postgresql":
        return True
    taken = conn.execute(
        select(func.pg_try_advisory_lock(WORKER_LOCK, func.hashtext(bindparam("c", claimant))))
    ).scalar_one()
    return bool(taken)


def _among(
    column: ColumnElement[Any], postgres: bool, name: str = "ids", of: Any = BigInteger
) -> ColumnElement[bool]:
    """``column`` is one of the values (of type `of`) of the list parameter `name`: on
    PostgreSQL one array parameter, so the text stays the same whatever the number of values
    and the server prepares it once; elsewhere an expanding IN list."""
    if postgres:
        return column == any_(bindparam(name, type_=ARRAY(of)))
    return column.in_(bindparam(name, expanding=True))


def lock_claimed(
    conn: Connection, tables: Tables, ids: Sequence[int], worker: str, since: datetime | None = None
) -> set[int]:
    """Row-lock the claimed rows that are still leased to `worker` and pending. The row lock keeps
    any other worker away while the handlers run, even if the lease runs out. `since`: no row of
    `ids` was received before it (see `_received_since`)."""
    stmt = _lock_claimed_statement(tables, conn.dialect.name == "postgresql")
    params = {"ids": list(ids), "claimant": worker, "since": since or _LONG_AGO}
    return set(conn.execute(stmt, params).scalars().all())


@cache
def _lock_claimed_statement(tables: Tables, postgres: bool) -> Any:
    i = tables.inbox
    return (
        select(i.c.id)
        .where(
            _among(i.c.id, postgres),
            i.c.locked_by == bindparam("claimant", type_=String),
            i.c.status == _inline(PENDING),
            *_received_since(i, postgres),
        )
        .with_for_update()
    )


#: `since` when the caller gives none: every partition may hold the rows.
_LONG_AGO = datetime(1970, 1, 1, tzinfo=UTC)


def _received_since(i: Any, postgres: bool) -> list[ColumnElement[bool]]:
    """On PostgreSQL, ``received_at >= :since``: the server then reads only the partitions
    from the one holding `since` on (pruned when the statement starts), not a probe of every
    partition's key index per id."""
    return (
        [i.c.received_at >= bindparam("since", type_=DateTime(timezone=True))] if postgres else []
    )


def mark_processed(
    conn: Connection,
    tables: Tables,
    ids: Sequence[int],
    since: datetime | None = None,
    *,
    claimant: str | None = None,
) -> set[int]:
    """Mark rows processed and release their lease; return the ids marked. `since`: no row
    of `ids` was received before it. `claimant`: only the rows still leased to it and
    pending, which the mark row-locks until the transaction ends (the worker marks a batch
    before its handlers run, in their transaction: one statement, not a lock and a mark)."""
    if not ids:
        return set()
    stmt = _mark_processed_statement(
        tables, conn.dialect.name == "postgresql", claimant is not None
    )
    params = {"ids": list(ids), "since": since or _LONG_AGO}
    if claimant is not None:
        params["claimant"] = claimant
    return set(conn.execute(stmt, params).scalars().all())


@cache
def _mark_processed_statement(tables: Tables, postgres: bool, leased: bool) -> Any:
    i = tables.inbox
    held = [i.c.locked_by == bindparam("claimant", type_=String), i.c.status == _inline(PENDING)]
    return (
        update(i)
        .where(_among(i.c.id, postgres), *_received_since(i, postgres), *(held if leased else ()))
        .values(
            status=PROCESSED,
            processed_at=db_now(),
            finished=i.c.finished + 1,
            locked_until=None,
            locked_by=None,
            last_error=None,
        )
        .returning(i.c.id)
    )


def mark_retry(conn: Connection, tables: Tables, row_id: int, error: str, delay: timedelta) -> None:
    """A handled failure: the row stays pending and is due again after `delay`."""
    i = tables.inbox
    conn.execute(
        update(i)
        .where(i.c.id == row_id)
        .values(
            finished=i.c.finished + 1,
            next_attempt_at=db_now_plus(delay),
            locked_until=None,
            locked_by=None,
            last_error=error,
        )
    )


def mark_dead(
    conn: Connection,
    tables: Tables,
    row_id: int,
    reason: str,
    error: str | None,
    *,
    finished: bool,
    fingerprint: str | None = None,
) -> None:
    """A row that will never be handled: status dead, with the reason, the last error and the
    `fingerprint` of why (default: the reason)."""
    i = tables.inbox
    values: dict[str, Any] = {
        "status": DEAD,
        "dead_reason": reason[:255],
        "fingerprint": (fingerprint or reason)[:255],
        "processed_at": db_now(),
        "locked_until": None,
        "locked_by": None,
    }
    if error is not None:
        values["last_error"] = error
    if finished:
        values["finished"] = i.c.finished + 1
    conn.execute(update(i).where(i.c.id == row_id).values(**values))


def release_claims(
    conn: Connection, tables: Tables, ids: Sequence[int], worker: str, *, away: bool = False
) -> None:
    """Give back claims this worker will not run, uncounted: it is stopping, or (`away`) it has no
    handler for them. An `away` row keeps `worker`'s name in ``locked_by`` (with no lease) and is
    due again to other workers after `AWAY`, to `worker` after twice that (`claimable`): a worker
    that has a handler takes it first, and this one does not claim it again at every poll. Either
    way the rows stay pending, so a later row of the same key is held behind them."""
    if ids:
        i = tables.inbox
        values: dict[str, Any] = {"locked_until": None, "attempts": i.c.attempts - 1}
        if away:
            values["next_attempt_at"] = db_now_plus(AWAY)
        else:
            values["locked_by"] = None
        conn.execute(
            update(i)
            .where(
                _among(i.c.id, conn.dialect.name == "postgresql"),
                i.c.locked_by == worker,
                i.c.status == PENDING,
            )
            .values(**values),
            {"ids": list(ids)},
        )


# --- instances and subscriptions (rolling deploys) ------------------------------------------------


def advertise_instance(
    conn: Connection,
    tables: Tables,
    service: str,
    instance: str,
    handlers: Sequence[Mapping[str, Any]],
    forget_after: timedelta,
) -> None:
    """Upsert `instance`'s row of `service` (its handlers, seen now); delete the rows of the
    service's instances not seen for `forget_after` (workers that died long ago)."""
    n = tables.instances
    insert = _insert(conn, n).values(
        service=service,
        instance=instance,
        handlers=list(handlers),
        started_at=db_now(),
        seen_at=db_now(),
    )
    conn.execute(
        insert.on_conflict_do_update(
            index_elements=[n.c.service, n.c.instance],
            set_={"handlers": insert.excluded.handlers, "seen_at": db_now()},
        )
    )
    conn.execute(delete(n).where(n.c.service == service, n.c.seen_at < db_now_plus(-forget_after)))


def forget_instance(conn: Connection, tables: Tables, service: str, instance: str) -> None:
    """Delete `instance`'s row of `service`: it stopped and handles nothing any more."""
    n = tables.instances
    conn.execute(delete(n).where(n.c.service == service, n.c.instance == instance))


def live_instances(
    conn: Connection, tables: Tables, service: str, grace: timedelta
) -> list[RowMapping]:
    """The instances of `service` seen within `grace` (database clock): instance and handlers."""
    n = tables.instances
    stmt = select(n.c.instance, n.c.handlers).where(
        n.c.service == service, n.c.seen_at >= db_now_plus(-grace)
    )
    return list(conn.execute(stmt).mappings().all())


def record_subscriptions(
    conn: Connection, tables: Tables, service: str, bindings: Sequence[tuple[str, str]]
) -> None:
    """Remember the (exchange, pattern) bindings of `service`'s inbox queue; a binding declared
    before keeps its first `subscribed_at`."""
    if not bindings:
        return
    s = tables.subscriptions
    insert = _insert(conn, s).values(
        [{"service": service, "exchange": e, "pattern": p} for e, p in sorted(set(bindings))]
    )
    conn.execute(
        insert.on_conflict_do_nothing(index_elements=[s.c.service, s.c.exchange, s.c.pattern])
    )


# --- connections (waker, pooler, worker limits) ---------------------------------------------------


def notify(conn: Connection | Session, channel: str, payload: str) -> None:
    """Send a notification on `channel` when `conn`'s transaction commits (a wake-up)."""
    conn.execute(select(func.pg_notify(bindparam("c", channel), bindparam("p", payload))))


def backend_pid(conn: Connection) -> int:
    """The process id of the server session `conn` runs on (the pooler probe compares them)."""
    return int(conn.execute(select(func.pg_backend_pid())).scalar_one())


def backend_exists(conn: Connection, pid: int) -> bool:
    """Whether server process `pid` still runs (a pooler may have closed its connection)."""
    activity = table("pg_stat_activity", column("pid"))
    found = select(activity.c.pid).where(activity.c.pid == bindparam("pid"))
    return bool(conn.execute(select(exists(found)), {"pid": pid}).scalar_one())


#: psycopg's ``prepare_threshold`` where ``prepare_threshold="auto"`` prepares (no pooler).
PREPARE_THRESHOLD = 5


def prepare_args(setting: int | str | None) -> dict[str, Any]:
    """The psycopg ``connect_args`` of the ``prepare_threshold`` setting (with "auto", the
    threshold of a direct connection; `unprepared_behind_pooler` turns it off where needed)."""
    return {"prepare_threshold": PREPARE_THRESHOLD if setting == "auto" else setting}


def unprepared_behind_pooler(engine: Engine | AsyncEngine) -> None:
    """Turn prepared statements off on each new connection of `engine` that goes through a
    connection pooler; leave them on (`PREPARE_THRESHOLD`) on a direct connection. A pooler in
    transaction mode runs each transaction on whichever server connection is free, so a statement
    prepared on one is missing (or already there) on the next: "prepared statement "_pg3_5" already
    exists". It is found by the backend pid: the one the server reports (``pg_backend_pid()``) is
    not the one the connection was given at its start (a pooler such as PgBouncer gives each client
    a key of its own). One query per new connection, then rolled back."""
    sync_engine = getattr(engine, "sync_engine", engine)

    @event.listens_for(sync_engine, "connect")
    def _check(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT pg_backend_pid()")
            server_pid = cursor.fetchone()[0]
        finally:
            cursor.close()
        dbapi_connection.rollback()
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        if server_pid != driver.info.backend_pid:
            driver.prepare_threshold = None


#: Server-side TCP keepalive (idle, interval, count; ignored over a Unix socket) and
#: ``tcp_user_timeout`` (ms, as the client's `database.CLIENT_BOUNDS`) of the roles'
#: transactions: what each bounds is in docs/failures.md ("A partition from PostgreSQL").
WORKER_KEEPALIVE = (10, 5, 3)
_KEEPALIVES = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
WORKER_USER_TIMEOUT = 10_000
#: Each statement of a role's transaction planned once per connection, and never compiled.
_PLANNED_ONCE = {"jit": "off", "plan_cache_mode": "force_generic_plan"}


def limit_worker(dbapi_connection: Any, lease: float, *, local: bool) -> None:
    """Set the limits of a worker's transactions on `dbapi_connection` (psycopg).
    ``idle_in_transaction_session_timeout`` = `lease`: a worker whose handler hangs keeps its row
    locks; the server ends its session after the lease, so the rows go back to the queue and
    the hung work can never commit. The TCP keepalive settings and ``tcp_user_timeout`` bound
    how long the transaction of a worker whose host vanished or was cut off lives on
    (`WORKER_KEEPALIVE`, `WORKER_USER_TIMEOUT`). `_PLANNED_ONCE`: planning the claim anew at each
    call, or compiling it, cost more than running it.

    `local`: for the transaction being begun only (``SET LOCAL``), so that a pooler in
    transaction mode hands no setting to its other clients and the limit holds on whichever
    server connection it picked; called from SQLAlchemy's ``begin`` event, the statement opens
    the transaction. Otherwise for the session, once, on a session that is the worker's own.
    """
    settings = {
        "idle_in_transaction_session_timeout": str(int(lease * 1000)),
        **{name: str(v) for name, v in zip(_KEEPALIVES, WORKER_KEEPALIVE, strict=True)},
        "tcp_user_timeout": str(WORKER_USER_TIMEOUT),
        **_PLANNED_ONCE,
    }
    # The DB-API face only (no psycopg keywords): the asyncio worker's adapter has no more.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(_LIMIT_SQL[local], [v for item in settings.items() for v in item])
    finally:
        cursor.close()


def keep_liveness_session_alive(conn: Connection) -> None:
    """Set `WORKER_KEEPALIVE` on the session that holds a worker's liveness lock, for the
    session: it is the worker's own for as long as it lives, never one a transaction pooler
    shares. The server then ends the session of a vanished worker, and the lock with it."""
    conn.execute(_tcp_bounds(local=False))


def bound_on_server(conn: Connection, *, flush_wait: bool = True) -> None:
    """Bound, on the server, how long the session of the transaction in hand outlives a client
    cut off from it, and its locks with it (`WORKER_USER_TIMEOUT`, `WORKER_KEEPALIVE`; the
    server's defaults: minutes or two hours). The relay and the receiver run it first in each
    transaction. Without `flush_wait`, also ``synchronous_commit = off`` (`_CLAIM_SETTINGS`);
    full scans off, as there. ``SET LOCAL``: nothing outlives the transaction, on whichever
    server connection a pooler in transaction mode picked. Does nothing on SQLite."""
    if is_postgres(conn):
        conn.execute(_tcp_bounds(local=True, user_timeout=True, flush_wait=flush_wait))


#: What `claim_inbox` sets for the rest of its transaction, by its `flush_wait`. Without one
#: (``synchronous_commit`` off) the commit waits for no disk flush: only for transactions a
#: server crash may undo harmlessly, the relay's marks (`bound_on_server`; the copies it
#: publishes again are dropped by the inbox) and a lone claim (undone with every later
#: transaction, WAL being flushed in order: claimed again, the attempt uncounted). Sorts and
#: full scans off: the plan a connection keeps, made on an empty inbox, stays on the indexes.
_CLAIM_SETTINGS = {
    (wait, locks): select(
        func.set_config("enable_sort", "off", True),
        func.set_config("enable_seqscan", "off", True),
        func.set_config("jit", "off", True),  # compiling the claim takes seconds; it runs in 1 ms
        *([] if wait else [func.set_config("synchronous_commit", "off", True)]),
        *([_xact_locks(CAP_LOCK)] if locks else []),  # claims of a capped type, one at a time
    )
    for wait in (True, False)
    for locks in (True, False)
}


@cache
def _tcp_bounds(*, local: bool, user_timeout: bool = False, flush_wait: bool = True) -> Select[Any]:
    """``SELECT set_config(...)`` of `WORKER_KEEPALIVE` (and `WORKER_USER_TIMEOUT`, full scans
    off, `_PLANNED_ONCE`; without `flush_wait`, ``synchronous_commit = off``), for the transaction
    (`local`) or the session. Built once: the relay and the receiver run it in every transaction."""
    settings: dict[str, Any] = dict(zip(_KEEPALIVES, WORKER_KEEPALIVE, strict=True))
    if user_timeout:
        settings.update(_PLANNED_ONCE, tcp_user_timeout=WORKER_USER_TIMEOUT, enable_seqscan="off")
    if not flush_wait:
        settings["synchronous_commit"] = "off"
    return select(*(func.set_config(name, str(v), local) for name, v in settings.items()))


# Fixed texts, values bound: ``set_config(name, value, true)`` is ``SET LOCAL``.
_LIMIT_SQL = {
    local: "SELECT " + ", ".join([f"set_config(%s, %s, {str(local).lower()})"] * 7)
    for local in (True, False)
}
