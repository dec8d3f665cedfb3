"""Raw PostgreSQL limits with psycopg alone, on copies of the library's tables (c, c', d, d', d'',
and the naive one-message-per-transaction loop n)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg
import psycopg.rows
from psycopg import sql
from psycopg.types.json import Jsonb

from bench.context import Context
from bench.timing import BenchError, Figure, Timer
from bench.wire import CLAIM_BATCH, INSERT_BATCH, OUTBOX_TXN
from outbox_inbox.messages import (
    EVENT,
    EVENTS_EXCHANGE,
    RECEIVED_COLUMNS,
    RECEIVED_JSON_COLUMNS,
    from_wire,
)

NAIVE_MAX_SECONDS = 20.0  # (n) stops after this long if rows are still pending

INBOX_COLUMNS = RECEIVED_COLUMNS
JSON_COLUMNS = frozenset(RECEIVED_JSON_COLUMNS)
OUTBOX_COLUMNS = (
    "message_id",
    "kind",
    "exchange",
    "routing_key",
    "payload",
    "headers",
    "version",
    "key",
    "priority",
    "expires_at",
    "correlation_id",
    "causation_id",
)


def _values(row: dict[str, Any], columns: Sequence[str]) -> list[Any]:
    return [Jsonb(row[c]) if c in JSON_COLUMNS else row[c] for c in columns]


def raw_batch_insert(conninfo: str, table: sql.Composable, rows: Sequence[dict[str, Any]]) -> Timer:
    """(c) multi-VALUES INSERT .. ON CONFLICT DO NOTHING RETURNING id, 250 rows, commit each."""
    cols = sql.SQL(", ").join(map(sql.Identifier, INBOX_COLUMNS))
    one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(INBOX_COLUMNS)))

    def statement(k: int) -> sql.Composed:
        return sql.SQL(
            "INSERT INTO {} ({}) VALUES {} ON CONFLICT (message_id) DO NOTHING RETURNING id"
        ).format(table, cols, sql.SQL(", ").join([one] * k))

    with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
        full = statement(INSERT_BATCH).as_string(conn)
        with Timer() as timer:
            for start in range(0, len(rows), INSERT_BATCH):
                chunk = rows[start : start + INSERT_BATCH]
                params = [v for row in chunk for v in _values(row, INBOX_COLUMNS)]
                query = full if len(chunk) == INSERT_BATCH else statement(len(chunk))
                cur.execute(query, params)
                cur.fetchall()
                conn.commit()
    return timer


def raw_single_inserts(
    conninfo: str, table: sql.Composable, rows: Sequence[dict[str, Any]]
) -> Timer:
    """(c') one INSERT per message, commit per 500: outbox.publish() minus the library."""
    cols = sql.SQL(", ").join(map(sql.Identifier, OUTBOX_COLUMNS))
    marks = sql.SQL(", ").join(sql.Placeholder() * len(OUTBOX_COLUMNS))
    with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
        query = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(table, cols, marks)
        with Timer() as timer:
            for i, row in enumerate(rows, 1):
                cur.execute(query, _values(row, OUTBOX_COLUMNS))
                if i % OUTBOX_TXN == 0:
                    conn.commit()
            conn.commit()
    return timer


def raw_claim(
    conninfo: str, table: sql.Composable, effects: sql.Composable | None, savepoints: bool
) -> tuple[int, Timer]:
    """(d) claim 50 pending rows FOR UPDATE SKIP LOCKED, mark them processed, commit; repeat.

    With `effects`, also insert one row per claimed row (d'), each in a savepoint if asked (d'').
    """
    claim = sql.SQL(
        "SELECT * FROM {} WHERE status = 'pending' ORDER BY priority DESC, id "
        "LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(table)
    mark = sql.SQL(
        "UPDATE {} SET status = 'processed', processed_at = now(), finished = finished + 1 "
        "WHERE id = ANY(%s)"
    ).format(table)
    effect = (
        sql.SQL("INSERT INTO {} (message_id, order_id) VALUES (%s, %s)").format(effects)
        if effects is not None
        else None
    )
    done = 0
    with (
        psycopg.connect(conninfo) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
        Timer() as timer,
    ):
        while True:
            rows = cur.execute(claim, (CLAIM_BATCH,)).fetchall()
            if not rows:
                conn.commit()
                break
            if effect is not None:
                for row in rows:
                    if savepoints:
                        cur.execute("SAVEPOINT handler")
                    cur.execute(effect, (row["message_id"], row["payload"]["order_id"]))
                    if savepoints:
                        cur.execute("RELEASE SAVEPOINT handler")
            cur.execute(mark, ([row["id"] for row in rows],))
            conn.commit()
            done += len(rows)
    return done, timer


def raw_naive_loop(conninfo: str, table: sql.Composable, max_seconds: float) -> tuple[int, Timer]:
    """(n) one message per transaction: claim 1 row FOR UPDATE SKIP LOCKED, mark it, commit.

    The loop a hand-written inbox worker starts as. It stops when no pending row is left or
    after `max_seconds`; the rate is the rows it marked per second.
    """
    claim = sql.SQL(
        "SELECT * FROM {} WHERE status = 'pending' ORDER BY priority DESC, id "
        "LIMIT 1 FOR UPDATE SKIP LOCKED"
    ).format(table)
    mark = sql.SQL(
        "UPDATE {} SET status = 'processed', processed_at = now(), finished = finished + 1 "
        "WHERE id = %s"
    ).format(table)
    done = 0
    with (
        psycopg.connect(conninfo) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
        Timer() as timer,
    ):
        deadline = time.perf_counter() + max_seconds
        while True:
            row = cur.execute(claim).fetchone()
            if row is None:
                conn.commit()
                break
            cur.execute(mark, (row["id"],))
            conn.commit()
            done += 1
            if time.perf_counter() > deadline:
                break
    return done, timer


def reseed_raw_inbox(ctx: Context) -> None:
    """N pending rows in the raw inbox again (the rows of (c)), and no effects."""
    ctx.sql(
        sql.SQL("TRUNCATE {}, {}").format(ctx.t("inbox"), ctx.t("effects")),
        sql.SQL("INSERT INTO {} SELECT * FROM {}").format(ctx.t("inbox"), ctx.t("inbox_seed")),
    )
    ctx.vacuum(ctx.t("inbox"), ctx.t("effects"))


def measure(ctx: Context) -> None:
    """(c), (c'), (d), (d'), (d'') and (n) on the raw schema's copies of the tables."""
    n = ctx.n
    rows = [from_wire(w) for w in ctx.wires]
    ctx.best_of(
        Figure("c", "psycopg insert inbox rows, 250 per INSERT + commit", "raw", "rows/s"),
        lambda: (n, raw_batch_insert(ctx.conninfo, ctx.t("inbox"), rows)),
        before=lambda: ctx.sql(sql.SQL("TRUNCATE {}").format(ctx.t("inbox"))),
    )
    outbox_rows = _outbox_rows(rows)
    ctx.best_of(
        Figure("c'", "psycopg insert outbox rows, 1 per INSERT, commit per 500", "raw", "rows/s"),
        lambda: (n, raw_single_inserts(ctx.conninfo, ctx.t("outbox"), outbox_rows)),
        before=lambda: ctx.sql(sql.SQL("TRUNCATE {}").format(ctx.t("outbox"))),
    )
    ctx.sql(
        sql.SQL("CREATE TABLE {} AS SELECT * FROM {}").format(ctx.t("inbox_seed"), ctx.t("inbox"))
    )
    _measure_claims(ctx)
    ctx.best_of(
        Figure(
            "n",
            "naive loop: claim 1 SKIP LOCKED + mark + commit, per row",
            "raw",
            "rows/s",
            note=f"each attempt stops after {NAIVE_MAX_SECONDS:.0f} s",
        ),
        lambda: raw_naive_loop(ctx.conninfo, ctx.t("inbox"), NAIVE_MAX_SECONDS),
        before=lambda: reseed_raw_inbox(ctx),
    )


def _outbox_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outbox rows of (c'): the columns `outbox.publish()` writes, for the same messages."""
    return [
        {
            "message_id": r["message_id"],
            "kind": EVENT,
            "exchange": EVENTS_EXCHANGE,
            "routing_key": r["routing_key"],
            "payload": r["payload"],
            "headers": {},
            "version": 1,
            "key": None,
            "priority": None,
            "expires_at": None,
            "correlation_id": r["correlation_id"],
            "causation_id": None,
        }
        for r in rows
    ]


def _measure_claims(ctx: Context) -> None:
    """(d), (d') and (d''), each over the N rows of (c), reseeded before each attempt."""
    n = ctx.n
    variants = (
        ("d", "claim 50 SKIP LOCKED + mark processed + commit", False, False),
        ("d'", "  the same + 1 INSERT per row (the handler's effect)", True, False),
        ("d''", "  the same + a SAVEPOINT around each INSERT", True, True),
    )
    for key, title, effect, savepoints in variants:

        def claim(
            effect: bool = effect, savepoints: bool = savepoints, key: str = key
        ) -> tuple[int, Timer]:
            done, timer = raw_claim(
                ctx.conninfo, ctx.t("inbox"), ctx.t("effects") if effect else None, savepoints
            )
            if done != n:
                raise BenchError(f"raw claim ({key}) processed {done} rows, expected {n}")
            return done, timer

        ctx.best_of(
            Figure(key, title, "raw", "rows/s"), claim, before=lambda: reseed_raw_inbox(ctx)
        )
