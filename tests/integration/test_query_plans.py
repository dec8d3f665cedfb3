"""The statements the roles, ``status`` and the dead-letter listing run stay on their indexes
when the partitions hold a million finished rows.

Each statement is captured as the library sends it (a ``before_cursor_execute`` hook while the
real function runs in a transaction rolled back), then explained with its own parameters: a
query changed into one that reads every finished row fails here. A Seq Scan is allowed only on
a relation known to be tiny (the catalogue's pg_database, a partition with a few rows).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, create_engine, event, text

from helpers import as_prepared, received_row
from outbox_inbox.migrate import alembic_config, upgrade
from outbox_inbox.partitions import partitions
from outbox_inbox.queries import operations, roles
from outbox_inbox.tables import Tables, build_tables
from outbox_inbox.testing.servers import PostgresHandle

SCHEMA = "outbox_inbox"
#: Finished rows of each table (processed inbox rows, published outbox rows), spread over
#: three partitions: the legacy one and the first two daily ones.
FINISHED = 1_000_000
#: Rows still to do, and dead ones, among them: a few hundred of each.
PENDING, DEAD = 300, 300
#: A relation with fewer rows than this may be read whole.
TINY = 1000


def _fill(url: str) -> None:
    """One INSERT … SELECT per table over generate_series: FINISHED finished rows, then DEAD
    dead rows in five fingerprints, then PENDING pending (unsent) rows, every tenth keyed;
    row g lands in partition g % 3. The series counts down, so that the rows still to do
    are the newest, as in a live table: a scan in id order meets every finished row first."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            legacy, first, second, *_ = partitions(conn, SCHEMA, "inbox_messages")
            assert legacy.upper == first.lower
            times = {
                "t0": first.lower - timedelta(hours=1),  # type: ignore[operator]
                "t1": first.lower + timedelta(hours=1),  # type: ignore[operator]
                "t2": second.lower + timedelta(hours=1),  # type: ignore[operator]
                "pending": PENDING,
                "dead": PENDING + DEAD,
                "n": FINISHED + PENDING + DEAD,
            }
            at = "(CASE g % 3 WHEN 0 THEN :t0 WHEN 1 THEN :t1 ELSE :t2 END)"
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.inbox_messages (message_id, kind, routing_key,"
                    " payload, headers, key, received_at, next_attempt_at, status,"
                    " processed_at, finished, dead_reason, fingerprint, last_error)"
                    " SELECT gen_random_uuid(), 'command', 'billing.invoice.create', '{}', '{}',"
                    " CASE WHEN g % 10 = 0 THEN 'order-' || (g % 1000) END,"
                    f" {at}, now() - interval '1 minute',"
                    " CASE WHEN g <= :pending THEN 'pending' WHEN g <= :dead THEN 'dead'"
                    " ELSE 'processed' END,"
                    f" CASE WHEN g > :pending THEN {at} + interval '1 second' END,"
                    " CASE WHEN g > :pending THEN 1 ELSE 0 END,"
                    " CASE WHEN g > :pending AND g <= :dead THEN 'rejected' END,"
                    " CASE WHEN g > :pending AND g <= :dead THEN 'fp-' || (g % 5) END,"
                    " CASE WHEN g <= :pending AND g % 20 = 0 THEN 'flaky' END"
                    " FROM generate_series(:n, 1, -1) AS g"
                ),
                times,
            )
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.outbox_messages (message_id, kind, exchange,"
                    " routing_key, payload, headers, key, created_at, available_at,"
                    " published_at, attempts, dead_at, dead_reason, fingerprint)"
                    " SELECT gen_random_uuid(), 'command', 'commands', 'billing.invoice.create',"
                    " '{}', '{}', CASE WHEN g % 10 = 0 THEN 'order-' || (g % 1000) END,"
                    f" {at}, now() - interval '1 minute',"
                    f" CASE WHEN g > :dead THEN {at} + interval '1 second' END,"
                    " CASE WHEN g > :pending THEN 1 ELSE 0 END,"
                    f" CASE WHEN g > :pending AND g <= :dead THEN {at} + interval '1 second' END,"
                    " CASE WHEN g > :pending AND g <= :dead THEN 'refused' END,"
                    " CASE WHEN g > :pending AND g <= :dead THEN 'fp-' || (g % 5) END"
                    " FROM generate_series(:n, 1, -1) AS g"
                ),
                times,
            )
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            # VACUUM too, as autovacuum does to a table of inserts: the visibility map lets an
            # index alone answer a count.
            conn.execute(text(f"VACUUM ANALYZE {SCHEMA}.inbox_messages, {SCHEMA}.outbox_messages"))
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def engine(postgres_server: PostgresHandle) -> Iterator[Any]:
    """One database for the module: migrated, filled, analysed."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    postgres_server.create_database(name)
    url = postgres_server.url(name)
    try:
        upgrade(alembic_config(url, schema=SCHEMA))
        _fill(url)
        engine = create_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(scope="module")
def tables() -> Tables:
    return build_tables(SCHEMA)


def _captured(engine: Any, call: Callable[[Connection], Any]) -> list[tuple[str, Any]]:
    """The statements `call` sends (text and parameters), run in a transaction rolled back."""
    seen: list[tuple[str, Any]] = []

    def hook(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    with engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", hook)
        try:
            with conn.begin() as transaction:
                result = call(conn)
                if isinstance(result, Iterator):
                    list(result)
                transaction.rollback()
        finally:
            event.remove(conn, "before_cursor_execute", hook)
    assert seen, "the call sent no statement"
    return seen


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan tree, depth first."""
    yield plan
    for child in plan.get("Plans", ()):
        yield from _scans(child)


#: Indexes that may be read whole (by their name on the partitioned table): the count of
#: processed rows in `status` (operations.inbox_status) reads their narrow index, not the table.
READ_WHOLE = {"ix_inbox_messages_processed"}


def _full_reads(plan: dict[str, Any], sizes: dict[str, float], roots: dict[str, str]) -> list[str]:
    """What `plan` reads whole of a relation or index of TINY rows or more: a Seq Scan, or an
    index scan with no Index Cond (a scan in the index's order, filtering)."""
    found = []
    for node in _scans(plan):
        if node["Node Type"] == "Seq Scan":
            name = node["Relation Name"]
        elif "Index Name" in node and "Index Cond" not in node:
            name = node["Index Name"]
            if roots.get(name, name) in READ_WHOLE:
                continue
        else:
            continue
        if sizes.get(f"{SCHEMA}.{name}", sizes.get(name, 0)) >= TINY:
            found.append(f"{node['Node Type']} of {name}")
    return found


def _generic_plan(
    conn: Connection,
    statement: str,
    parameters: Any,
    settings: Callable[[Connection], Any],
    sent: list[tuple[str, Any]],
) -> Any:
    """The plan a role's connection keeps for `statement`: prepared, with `settings` (the
    role's, which force a generic plan) and the settings statements `sent` before it run
    first, in a transaction rolled back."""
    numbered, names = as_prepared(statement)
    values = psycopg.sql.SQL(", ").join(psycopg.sql.Literal(parameters[n]) for n in names)
    with conn.begin() as transaction:
        settings(conn)
        for setting, given in sent:
            conn.exec_driver_sql(setting, given)
        with conn.connection.dbapi_connection.cursor() as cursor:  # no placeholders: as sent
            cursor.execute(f"PREPARE planned AS {numbered}")
            cursor.execute(
                psycopg.sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE planned({})").format(values)
            )
            plan = cursor.fetchone()[0]
            cursor.execute("DEALLOCATE planned")
        transaction.rollback()
    return plan


def _assert_no_scan_of_a_large_relation(
    engine: Any,
    call: Callable[[Connection], Any],
    settings: Callable[[Connection], Any] | None = None,
) -> list[dict[str, Any]]:
    """Explain each statement `call` sends; fail if one reads a large relation or index whole
    (`_full_reads`, by the estimates of the last ANALYZE), printing the statement and its
    plan. Returns the plans, one per statement. With a role's `settings`, each statement's
    generic plan is explained too (`_generic_plan`): the one a role's connection keeps."""
    offending, plans = [], []
    with engine.connect() as conn:
        sizes = dict(
            conn.execute(text("SELECT oid::regclass::text, reltuples FROM pg_class")).all()
        )
        # A partition's index -> the partitioned table's index it belongs to.
        roots = dict(
            conn.execute(
                text(
                    "SELECT c.relname, p.relname FROM pg_inherits i"
                    " JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent"
                    " WHERE c.relkind = 'i'"
                )
            ).all()
        )
        conn.rollback()
        sent: list[tuple[str, Any]] = []  # the settings statements sent so far
        for statement, parameters in _captured(engine, call):
            with conn.begin() as transaction:
                plan = conn.exec_driver_sql(
                    "EXPLAIN (FORMAT JSON) " + statement, parameters
                ).scalar_one()
                transaction.rollback()
            explained = [plan]
            if settings is not None:
                explained.append(_generic_plan(conn, statement, parameters, settings, sent))
            if statement.startswith("SELECT set_config"):
                sent.append((statement, parameters))
            for plan in explained:
                plan = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
                plans.append(plan)
                read = _full_reads(plan, sizes, roots)
                if read:
                    offending.append(
                        f"{', '.join(read)} in\n{statement}\n{json.dumps(plan, indent=1)}"
                    )
    assert not offending, "\n\n".join(offending)
    return plans


def _pending_ids(engine: Any, table: str) -> list[int]:
    where = "status = 'pending'" if table == "inbox_messages" else "published_at IS NULL"
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(f"SELECT id FROM {SCHEMA}.{table} WHERE {where} ORDER BY id LIMIT 10")
            ).scalars()
        )


def test_the_fill_spreads_finished_rows_over_three_partitions(engine: Any) -> None:
    with engine.connect() as conn:
        for table in ("inbox_messages", "outbox_messages"):
            counts = conn.execute(
                text(
                    "SELECT c.relname, c.reltuples FROM pg_inherits i JOIN pg_class c"
                    " ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"
                    " AND c.reltuples > 0"
                ),
                {"t": f"{SCHEMA}.{table}"},
            ).all()
            assert len(counts) == 3
            assert sum(n for _, n in counts) > 0.9 * FINISHED


def test_the_workers_claim_uses_the_index_of_pending_rows(engine: Any, tables: Tables) -> None:
    _assert_no_scan_of_a_large_relation(
        engine,
        lambda conn: roles.claim_inbox(conn, tables, "w-1", 10, timedelta(seconds=30)),
        _worker_settings,
    )


def test_a_claim_under_a_cap_and_a_rate_counts_on_the_indexes(engine: Any, tables: Tables) -> None:
    caps, rates = {"billing.invoice.create": 4}, {"billing.invoice.create": (5, 60.0)}
    plans = _assert_no_scan_of_a_large_relation(
        engine,
        lambda conn: roles.claim_inbox(
            conn, tables, "w-1", 10, timedelta(seconds=30), caps=caps, rates=rates
        ),
        _worker_settings,
    )
    read = {n.get("Relation Name", "") for plan in plans for n in _scans(plan)}
    # The rate reads its counts, not the rows finished in its period.
    assert "inbox_rate_counts" in read, read


def test_status_counts_a_rate_on_its_counts(engine: Any, tables: Tables) -> None:
    def status(conn: Connection) -> Any:
        rated = [{"kind": "command", "pattern": "billing.invoice.create", "rate": [5, 60.0]}]
        roles.advertise_instance(
            conn, tables, "billing", "i-1", rated, forget_after=timedelta(minutes=1)
        )
        return operations.inbox_status(conn, tables)

    _assert_no_scan_of_a_large_relation(engine, status)


def _worker_settings(conn: Connection) -> None:
    """The limits a worker's transactions start with (`roles.limit_worker`)."""
    roles.limit_worker(conn.connection.dbapi_connection, 30.0, local=True)


def test_the_workers_mark_reads_rows_by_id(engine: Any, tables: Tables) -> None:
    ids = _pending_ids(engine, "inbox_messages")
    _assert_no_scan_of_a_large_relation(
        engine, lambda conn: roles.mark_processed(conn, tables, ids), _worker_settings
    )


def test_the_relays_claim_uses_the_index_of_unsent_rows(engine: Any, tables: Tables) -> None:
    _assert_no_scan_of_a_large_relation(
        engine, lambda conn: roles.claim_outbox(conn, tables, 10), roles.bound_on_server
    )


def test_the_relays_mark_reads_rows_by_id(engine: Any, tables: Tables) -> None:
    ids = _pending_ids(engine, "outbox_messages")
    _assert_no_scan_of_a_large_relation(
        engine, lambda conn: roles.mark_published(conn, tables, ids), roles.bound_on_server
    )


@pytest.mark.parametrize(
    "query",
    [
        lambda conn, tables: operations.outbox_status(conn, tables),
        lambda conn, tables: operations.inbox_status(conn, tables),
        lambda conn, tables: operations.held_keys(conn, tables, 20),
    ],
    ids=["outbox_status", "inbox_status", "held_keys"],
)
def test_status_reads_no_finished_row(engine: Any, tables: Tables, query: Any) -> None:
    _assert_no_scan_of_a_large_relation(engine, lambda conn: query(conn, tables))


@pytest.mark.parametrize(
    "query",
    [
        lambda conn, tables: operations.dead_rows(conn, tables.inbox),
        lambda conn, tables: operations.dead_rows(conn, tables.outbox),
        lambda conn, tables: operations.dead_groups(conn, tables),
    ],
    ids=["dead_inbox_rows", "dead_outbox_rows", "dead_groups"],
)
def test_the_dead_letter_listing_reads_no_finished_row(
    engine: Any, tables: Tables, query: Any
) -> None:
    _assert_no_scan_of_a_large_relation(engine, lambda conn: query(conn, tables))


def test_the_receivers_insert_probes_each_partitions_message_id_index(
    engine: Any, tables: Tables
) -> None:
    with engine.connect() as conn:
        stored = conn.execute(
            text(f"SELECT message_id FROM {SCHEMA}.inbox_messages ORDER BY id DESC LIMIT 1")
        ).scalar_one()
    batch = [
        received_row(message_id=message_id, payload={"n": n})
        for n, message_id in enumerate([stored, uuid.uuid4(), uuid.uuid4()])
    ]
    plans = _assert_no_scan_of_a_large_relation(
        engine, lambda conn: roles.insert_inbox(conn, tables, batch), roles.bound_on_server
    )
    probed = {
        node["Relation Name"]
        for plan in plans
        for node in _scans(plan)
        if node["Node Type"] in ("Index Scan", "Index Only Scan")
        and node["Index Name"].endswith("_message_id")
        and "message_id" in node.get("Index Cond", "")
    }
    with engine.connect() as conn:
        filled = set(
            conn.execute(
                text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                    " WHERE i.inhparent = to_regclass(:t) AND c.reltuples >= :tiny"
                ),
                {"t": f"{SCHEMA}.inbox_messages", "tiny": TINY},
            ).scalars()
        )
    assert len(filled) == 3
    assert filled <= probed, json.dumps(plans, indent=1)
