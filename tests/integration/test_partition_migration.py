"""Existing installs migrate to time partitions (revision 0006) without downtime.

A database at revision 0005 holds rows in every state; a service runs its relay, receiver and
worker on it, and a writer sends through the outbox, one business transaction per message,
while ``upgrade(…, "heads")`` runs on another connection. No write fails, every message is
handled once, the old rows keep their state and ids, and the tables come out partitioned.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from helpers import FAST, rows, scalar, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.migrate import alembic_config, check, downgrade, upgrade
from outbox_inbox.partitions import partitions

SCHEMA = "outbox_inbox"
TABLES = ("outbox_messages", "inbox_messages")

#: One seeded row per state, a few of each: every state the migration must leave alone. The
#: pending and unsent ones wait far in the future, so no role of the running service takes
#: them; the leased one is leased, by a claimant that holds no liveness lock, for a day.
INBOX_STATES = {
    "pending": "status = 'pending', next_attempt_at = now() + interval '1 day'",
    "leased": "status = 'pending', next_attempt_at = now() - interval '1 minute',"
    " locked_until = now() + interval '1 day', locked_by = 'gone+lease-only', attempts = 1",
    "processed": "status = 'processed', processed_at = now() - interval '1 hour', finished = 1",
    "dead": "status = 'dead', processed_at = now() - interval '1 hour', dead_reason = 'rejected',"
    " fingerprint = 'seeded', finished = 1",
    "parked": "status = 'parked', processed_at = now() - interval '1 hour',"
    " dead_reason = 'rejected', fingerprint = 'seeded', finished = 1",
}
OUTBOX_STATES = {
    "unsent": "available_at = now() + interval '1 day'",
    "published": "published_at = now() - interval '1 hour', attempts = 1",
    "expired": "expired_at = now() - interval '1 hour'",
    "dead": "dead_at = now() - interval '1 hour', dead_reason = 'refused', fingerprint = 'seeded'",
    "parked": "dead_at = now() - interval '1 hour', dead_reason = 'refused',"
    " fingerprint = 'seeded', parked_at = now()",
}
#: Finished rows besides them, so that the migration's index build and CHECK have work to do.
BULK = 50_000


def _seed(url: str) -> None:
    """Three rows of every state in each table (routing key ``billing.seed.<state>``), and
    BULK processed and published ones (``billing.seed.bulk``), all received two hours ago."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for state, sets in INBOX_STATES.items():
                conn.execute(
                    text(
                        f"INSERT INTO {SCHEMA}.inbox_messages (message_id, kind, routing_key,"
                        " payload, headers, received_at) SELECT gen_random_uuid(), 'command',"
                        " :key, '{}', '{}', now() - interval '2 hours' FROM generate_series(1, 3)"
                    ),
                    {"key": f"billing.seed.{state}"},
                )
                conn.execute(
                    text(f"UPDATE {SCHEMA}.inbox_messages SET {sets} WHERE routing_key = :key"),
                    {"key": f"billing.seed.{state}"},
                )
            for state, sets in OUTBOX_STATES.items():
                conn.execute(
                    text(
                        f"INSERT INTO {SCHEMA}.outbox_messages (message_id, kind, exchange,"
                        " routing_key, payload, headers, created_at) SELECT gen_random_uuid(),"
                        " 'command', 'commands', :key, '{}', '{}', now() - interval '2 hours'"
                        " FROM generate_series(1, 3)"
                    ),
                    {"key": f"billing.seed.{state}"},
                )
                conn.execute(
                    text(f"UPDATE {SCHEMA}.outbox_messages SET {sets} WHERE routing_key = :key"),
                    {"key": f"billing.seed.{state}"},
                )
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.inbox_messages (message_id, kind, routing_key, payload,"
                    " headers, received_at, status, processed_at, finished)"
                    " SELECT gen_random_uuid(), 'command', 'billing.seed.bulk', '{}', '{}',"
                    " now() - interval '2 hours', 'processed', now() - interval '1 hour', 1"
                    " FROM generate_series(1, :n)"
                ),
                {"n": BULK},
            )
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.outbox_messages (message_id, kind, exchange,"
                    " routing_key, payload, headers, created_at, published_at) SELECT"
                    " gen_random_uuid(), 'command', 'commands', 'billing.seed.bulk', '{}', '{}',"
                    " now() - interval '2 hours', now() - interval '1 hour'"
                    " FROM generate_series(1, :n)"
                ),
                {"n": BULK},
            )
            conn.execute(
                text(
                    "CREATE TABLE effects (message_id text PRIMARY KEY, type text NOT NULL,"
                    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
                )
            )
    finally:
        engine.dispose()


def _seeded(url: str) -> dict[str, list[Any]]:
    """Every seeded row but the bulk ones, whole, in id order, by table."""
    return {
        t: rows(
            url,
            f"SELECT * FROM {SCHEMA}.{t} WHERE routing_key LIKE 'billing.seed.%'"
            " AND routing_key <> 'billing.seed.bulk' ORDER BY id",
        )
        for t in TABLES
    }


def _everything(url: str) -> dict[str, list[Any]]:
    return {t: rows(url, f"SELECT * FROM {SCHEMA}.{t} ORDER BY id") for t in TABLES}


def _bulk_states(url: str) -> list[Any]:
    return [
        rows(
            url,
            f"SELECT status, count(*), min(id), max(id) FROM {SCHEMA}.inbox_messages"
            " WHERE routing_key = 'billing.seed.bulk' GROUP BY status",
        ),
        rows(
            url,
            f"SELECT published_at IS NOT NULL, count(*), min(id), max(id)"
            f" FROM {SCHEMA}.outbox_messages WHERE routing_key = 'billing.seed.bulk'"
            " GROUP BY 1",
        ),
    ]


def _partitioned(url: str) -> set[str]:
    return {
        r[0]
        for r in rows(
            url,
            "SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s",
            s=SCHEMA,
        )
    }


@dataclass
class Write:
    message_id: uuid.UUID
    started: float
    ended: float


@dataclass
class Writer:
    """Sends one command per business transaction until stopped; records each write's
    times and any error."""

    service: Service
    stop: threading.Event = field(default_factory=threading.Event)
    writes: list[Write] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                with self.service.session() as session, session.begin():
                    message_id = self.service.outbox.send(
                        session, "billing", "invoice.create", {"n": n}
                    )
            except Exception as exc:
                self.errors.append(exc)
            else:
                self.writes.append(Write(message_id, started, time.monotonic()))
            time.sleep(0.01)


def test_a_maintenance_pass_on_tables_not_yet_partitioned_does_nothing(db_url: str) -> None:
    """A service started before 0006 runs its maintenance passes on plain tables: they make
    no partition (one could not be attached), leave no table behind, and raise nothing."""
    upgrade(alembic_config(db_url, schema=SCHEMA), "0005")
    service = Service("billing", db_url=db_url, mq_url=None, **FAST)
    try:
        before = rows(db_url, "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p')")
        result = service.maintain()
        after = rows(db_url, "SELECT relname FROM pg_class WHERE relkind IN ('r', 'p')")
    finally:
        service.close()
    assert (result.created, result.dropped, result.kept, result.busy) == ([], [], {}, False)
    assert sorted(after) == sorted(before)


def test_tables_are_partitioned_live_while_a_service_writes_relays_receives_and_handles(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox_inbox")
    config = alembic_config(db_url, schema=SCHEMA)
    upgrade(config, "0005")
    _seed(db_url)
    seeded = _seeded(db_url)
    bulk = _bulk_states(db_url)
    newest_before = {t: scalar(db_url, f"SELECT max(id) FROM {SCHEMA}.{t}") for t in TABLES}

    # Maintenance every half second: passes run on the plain tables, during the migration
    # and on the partitioned ones.
    service = Service("billing", db_url=db_url, mq_url=mq_url, maintenance_interval=0.5, **FAST)

    @service.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
            {"m": str(message.message_id), "t": message.type},
        )

    writer = Writer(service)
    thread = threading.Thread(target=writer.run, name="writer")
    service.start()
    thread.start()
    try:
        wait_until(lambda: len(writer.writes) >= 50, what="50 writes before the migration")
        migration_started = time.monotonic()
        upgrade(config, "heads")
        migration_ended = time.monotonic()
        wait_until(
            lambda: sum(w.started > migration_ended for w in writer.writes) >= 50,
            what="50 writes after the migration",
        )
    finally:
        writer.stop.set()
        thread.join(30)
    try:
        assert writer.errors == []
        during = [
            w
            for w in writer.writes
            if w.ended >= migration_started and w.started <= migration_ended
        ]
        longest = max(w.ended - w.started for w in during) if during else 0.0
        print(
            f"migration took {migration_ended - migration_started:.2f} s; {len(during)} writes "
            f"overlapped it, the longest took {longest:.3f} s"
        )
        assert during, "no write overlapped the migration"
        assert longest < 10.0

        written = [str(w.message_id) for w in writer.writes]
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM effects") >= len(written),
            timeout=60,
            what=f"{len(written)} messages handled",
        )
    finally:
        service.stop()
    # Each message handled once: one effect, one inbox row, processed; each outbox row sent.
    assert sorted(r[0] for r in rows(db_url, "SELECT message_id FROM effects")) == sorted(written)
    assert rows(
        db_url,
        f"SELECT status, count(*), count(DISTINCT message_id) FROM {SCHEMA}.inbox_messages"
        " WHERE routing_key = 'billing.invoice.create' GROUP BY status",
    ) == [("processed", len(written), len(written))]
    assert rows(
        db_url,
        f"SELECT count(*), count(published_at) FROM {SCHEMA}.outbox_messages"
        " WHERE routing_key = 'billing.invoice.create'",
    ) == [(len(written), len(written))]

    # The old rows kept their state and ids; new ids continue after theirs, none reused.
    # (0009 added the inbox's last column, ``tenant``: "" on every old row.)
    assert _seeded(db_url) == seeded | {
        "inbox_messages": [(*r, "") for r in seeded["inbox_messages"]]
    }
    assert _bulk_states(db_url) == bulk
    for t in TABLES:
        assert scalar(db_url, f"SELECT count(*) = count(DISTINCT id) FROM {SCHEMA}.{t}")
    after = [str(w.message_id) for w in writer.writes if w.started > migration_ended]
    assert scalar(
        db_url,
        f"SELECT min(id) FROM {SCHEMA}.outbox_messages WHERE message_id = ANY(CAST(:m AS uuid[]))",
        m=after,
    ) > max(
        newest_before["outbox_messages"],
        scalar(
            db_url,
            f"SELECT max(id) FROM {SCHEMA}.outbox_messages"
            " WHERE message_id = ANY(CAST(:m AS uuid[]))",
            m=[str(w.message_id) for w in writer.writes if w.ended < migration_started],
        ),
    )
    assert (
        scalar(
            db_url,
            f"SELECT min(id) FROM {SCHEMA}.inbox_messages"
            " WHERE message_id = ANY(CAST(:m AS uuid[]))",
            m=after,
        )
        > newest_before["inbox_messages"]
    )

    # Partitioned: the old table attached first, then daily partitions from its bound on.
    assert _partitioned(db_url) == set(TABLES)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            for t in TABLES:
                legacy, *days = partitions(conn, SCHEMA, t)
                assert (legacy.name, legacy.lower) == (f"{t}_legacy", None)
                assert len(days) >= 7
                assert days[0].lower == legacy.upper
                for before, day in zip([legacy, *days], days, strict=False):
                    assert day.name == f"{t}_p{day.lower:%Y%m%d}"
                    assert day.lower == before.upper
                    assert (day.upper - day.lower).days == 1  # type: ignore[operator]
                # Every index the attach needed was built beforehand and adopted: none was
                # built under its lock (PostgreSQL would have named it …_idx). Indexes a later
                # migration made on the partitioned table (0008's, 0009's, 0013's) are named so.
                built = conn.execute(
                    text(
                        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                        " LEFT JOIN pg_inherits h ON h.inhrelid = i.indexrelid"
                        " LEFT JOIN pg_class p ON p.oid = h.inhparent"
                        " WHERE i.indrelid = to_regclass(:t) AND c.relname LIKE '%\\_idx'"
                        " AND coalesce(p.relname, '') NOT IN"
                        " ('ix_inbox_messages_pending_type', 'ix_inbox_messages_leased',"
                        " 'ix_outbox_messages_relayed', 'ix_outbox_messages_webhook')"
                    ),
                    {"t": f"{SCHEMA}.{t}_legacy"},
                ).all()
                assert built == []
            assert check(conn, SCHEMA) == []
    finally:
        engine.dispose()

    # No role crashed, no maintenance pass failed, before, during or after the migration.
    troubles = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR or "maintenance failed" in r.getMessage()
    ]
    assert troubles == []

    # Down to 0005 and up again: every row kept, ids continue.
    everything = _everything(db_url)
    downgrade(config, "0005")
    assert _partitioned(db_url) == set()
    inbox = [tuple(r[:-1]) for r in everything["inbox_messages"]]  # 0009's tenant dropped
    assert _everything(db_url) == everything | {"inbox_messages": inbox}
    upgrade(config, "heads")
    assert _partitioned(db_url) == set(TABLES)
    assert _everything(db_url) == everything
    with service.session() as session, session.begin():
        latest = service.outbox.send(session, "billing", "invoice.create", {"n": "last"})
    assert scalar(
        db_url, f"SELECT id FROM {SCHEMA}.outbox_messages WHERE message_id = :m", m=str(latest)
    ) > max(r.id for r in everything["outbox_messages"])
    service.close()
