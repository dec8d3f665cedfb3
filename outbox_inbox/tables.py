"""The outbox and inbox tables: the one SQLAlchemy Core metadata the migrations are made from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    Uuid,
    and_,
    func,
    literal,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from .config import validate_identifier

#: Also the migrations' (alembic applies it to their operations): a revision names a CHECK
#: constraint by its short name (``kind``) or passes a whole one through ``op.f()``, else the
#: whole name is prefixed again (``ck_t_ck_t_kind``, which revision 0007 renamed).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "pk": "pk_%(table_name)s",
}

#: Inbox row states. A row is `pending` until it is `processed` or `dead`; an operator may
#: set a dead row aside as `parked` (out of the dead letters, kept, replayable later).
PENDING, PROCESSED, DEAD, PARKED = "pending", "processed", "dead", "parked"
#: The exchange of an outbox row that is a webhook delivery: this and the endpoint's name
#: (outbox_inbox.webhooks). The relay leaves such rows to the webhooks role.
WEBHOOK = "webhook:"

#: Name of the alembic version table, kept in the library's schema so that it never collides
#: with the service's own `alembic_version`.
VERSION_TABLE = "outbox_inbox_version"

_BigId = BigInteger().with_variant(Integer(), "sqlite")
_Json = JSON().with_variant(JSONB(), "postgresql")
_Time = DateTime(timezone=True)


@dataclass(frozen=True)
class Tables:
    """The library's tables of one schema, sharing one `MetaData`."""

    schema: str
    metadata: MetaData
    outbox: Table
    inbox: Table
    deliveries: Table
    subscriptions: Table
    archive_files: Table
    instances: Table
    rate_counts: Table
    payloads: Table
    tenant_leases: Table


def outbox_webhook(outbox: Table | Any) -> ColumnElement[bool]:
    """The predicate of webhook delivery rows (webhooks.py), its pattern in the statement's
    text: the partial indexes that keep them apart from the relay's rows name it."""
    return outbox.c.exchange.like(literal(WEBHOOK + "%", literal_execute=True))


def outbox_unsent(outbox: Table | Any) -> ColumnElement[bool]:
    """The predicate of outbox rows still to be published: not published, expired or dead."""
    return and_(
        outbox.c.published_at.is_(None), outbox.c.expired_at.is_(None), outbox.c.dead_at.is_(None)
    )


@cache
def build_tables(schema: str | None = "outbox_inbox") -> Tables:
    """Return the tables of `schema` (validated as an identifier); None means the default schema.

    The result is cached: every caller asking for one schema shares one `MetaData`."""
    if schema is not None:
        validate_identifier(schema)
    metadata = MetaData(schema=schema, naming_convention=NAMING_CONVENTION)

    outbox = _outbox_table(metadata)
    inbox = _inbox_table(metadata)
    deliveries = _deliveries_table(metadata)
    subscriptions = _subscriptions_table(metadata)
    tables = (_archive_files_table(metadata), _instances_table(metadata))
    rate_counts = Table(  # the claims of a rate-capped type per tenth of its period (`rate=`)
        "inbox_rate_counts",
        metadata,
        Column("routing_key", String(255), primary_key=True),
        # The tenth's start: milliseconds since 1970 on the database clock.
        Column("bucket", BigInteger, primary_key=True, autoincrement=False),
        Column("claimed", Integer, nullable=False),
    )
    # The PostgreSQL payload store's (outbox_inbox.claim_check): a payload sent by reference,
    # written in the sender's transaction, removed after the retention.
    payloads = Table(
        "payloads",
        metadata,
        Column("key", String(255), primary_key=True),
        Column("data", LargeBinary, nullable=False),
        Column("created_at", _Time, nullable=False, server_default=func.now()),
    )
    # The tenants fleet's (outbox_inbox.tenants): who drains a tenant's outbox (role "relay")
    # or inbox ("worker") now, until when on the database clock; deleted when it is done.
    leases = Table(
        "tenant_leases",
        metadata,
        Column("service", String(255), primary_key=True),
        Column("role", String(16), primary_key=True),
        Column("tenant", String(255), primary_key=True),
        Column("holder", String(255), nullable=False),
        Column("locked_until", _Time, nullable=False),
    )
    return Tables(
        schema or "",
        *(metadata, outbox, inbox, deliveries, subscriptions, *tables, rate_counts, payloads),
        leases,
    )


def _outbox_table(metadata: MetaData) -> Table:
    """The outbox table and its indexes."""
    outbox = Table(
        "outbox_messages",
        metadata,
        # The identity orders rows of one ordering key; writers of one key are serialized
        # (see queries.roles.insert_outbox), so for them it is also the commit order.
        Column("id", _BigId, Identity(always=False), primary_key=True),
        Column("message_id", Uuid(as_uuid=True), nullable=False, unique=True),
        Column("kind", String(16), nullable=False),
        Column("exchange", String(255), nullable=False),
        Column("routing_key", String(255), nullable=False),
        Column("payload", _Json, nullable=False),
        Column("headers", _Json, nullable=False),
        Column("version", Integer, nullable=False, server_default=text("1")),
        Column("correlation_id", String(255), nullable=True),
        Column("causation_id", String(255), nullable=True),
        Column("key", String(255), nullable=True),
        Column("priority", SmallInteger, nullable=True),
        Column("created_at", _Time, nullable=False, server_default=func.now()),
        Column("available_at", _Time, nullable=False, server_default=func.now()),
        Column("expires_at", _Time, nullable=True),
        Column("published_at", _Time, nullable=True),
        # Set instead of published_at when the row expired before it could be published.
        Column("expired_at", _Time, nullable=True),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        # Set instead of published_at when the broker refused the row on its every attempt
        # (relay_max_attempts), with why in dead_reason and the broker's words in last_error.
        Column("dead_at", _Time, nullable=True),
        Column("dead_reason", String(255), nullable=True),
        *_dead_letter_columns(),
        # Set on a dead row an operator set aside (dead_at stays): out of the dead letters.
        Column("parked_at", _Time, nullable=True),
        CheckConstraint("kind IN ('command', 'event')", name="kind"),
    )
    _outbox_indexes(outbox)
    return outbox


def _outbox_indexes(outbox: Table) -> None:
    """The partial indexes of the rows to publish (all, and those with a key) and the dead."""
    unsent = outbox_unsent(outbox)
    _partial_index("ix_outbox_messages_unpublished", unsent, outbox.c.id)
    # The relay's rows and the webhook deliveries apart: an endpoint's deliveries waiting for a
    # retry never lie in the relay's path, and an endpoint's due ones are read by time.
    hook = outbox_webhook(outbox)
    _partial_index("ix_outbox_messages_relayed", unsent & ~hook, outbox.c.id)
    by_time = (outbox.c.exchange, outbox.c.available_at, outbox.c.id)
    _partial_index("ix_outbox_messages_webhook", unsent & hook, *by_time)
    has_key = unsent & outbox.c.key.is_not(None)
    _partial_index("ix_outbox_messages_unpublished_key", has_key, outbox.c.key, outbox.c.id)
    _partial_index("ix_outbox_messages_dead", outbox.c.dead_at.is_not(None), outbox.c.id)
    # Dead-letter groups: GROUP BY fingerprint reads this index alone on PostgreSQL.
    _partial_index(
        "ix_outbox_messages_dead_fingerprint",
        outbox.c.dead_at.is_not(None) & outbox.c.parked_at.is_(None),
        outbox.c.fingerprint,
        postgresql_include=["routing_key", "dead_at", "replays"],
    )


def _partial_index(name: str, where: Any, *columns: Any, **options: Any) -> Index:
    """An index of the rows `where` selects, partial alike on PostgreSQL and SQLite."""
    return Index(name, *columns, postgresql_where=where, sqlite_where=where, **options)


def _dead_letter_columns() -> list[Column[Any]]:
    """What dead-letter groups need of a row: the fingerprint of why it died (set with the
    dead mark, kept by a replay until the row dies again), and its replays."""
    return [
        Column("fingerprint", String(255), nullable=True),
        Column("replays", Integer, nullable=False, server_default=text("0")),
        Column("replayed_at", _Time, nullable=True),
    ]


def _inbox_table(metadata: MetaData) -> Table:
    """The inbox table and its indexes."""
    inbox = Table(
        "inbox_messages",
        metadata,
        Column("id", _BigId, Identity(always=False), primary_key=True),
        Column("message_id", Uuid(as_uuid=True), nullable=False, unique=True),
        Column("source", String(255), nullable=True),
        Column("kind", String(16), nullable=False),
        Column("routing_key", String(255), nullable=False),
        Column("payload", _Json, nullable=False),
        Column("headers", _Json, nullable=False),
        Column("version", Integer, nullable=False, server_default=text("1")),
        Column("correlation_id", String(255), nullable=True),
        Column("causation_id", String(255), nullable=True),
        Column("key", String(255), nullable=True),
        Column("tenant", String(255), nullable=False, server_default=text("''")),
        Column("priority", SmallInteger, nullable=False, server_default=text("0")),
        Column("created_at", _Time, nullable=True),
        Column("expires_at", _Time, nullable=True),
        Column("received_at", _Time, nullable=False, server_default=func.now()),
        Column("status", String(16), nullable=False, server_default=text("'pending'")),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("finished", Integer, nullable=False, server_default=text("0")),
        Column("next_attempt_at", _Time, nullable=False, server_default=func.now()),
        Column("locked_until", _Time, nullable=True),
        Column("locked_by", String(255), nullable=True),
        Column("processed_at", _Time, nullable=True),
        Column("last_error", Text, nullable=True),
        Column("dead_reason", String(255), nullable=True),
        *_dead_letter_columns(),
        CheckConstraint("status IN ('pending', 'processed', 'dead', 'parked')", name="status"),
        CheckConstraint("kind IN ('command', 'event')", name="kind"),
    )
    pending = inbox.c.status == PENDING
    _partial_index("ix_inbox_messages_pending", pending, inbox.c.priority.desc(), inbox.c.id)
    has_key = pending & inbox.c.key.is_not(None)
    _partial_index("ix_inbox_messages_pending_key", has_key, inbox.c.key, inbox.c.id)
    # The fair claim: the types and tenants waiting (one probe each), each one's rows in claim
    # order, and the rows of a type leased now (counted against its cap until released).
    by_type = (inbox.c.routing_key, inbox.c.tenant, inbox.c.priority.desc(), inbox.c.id)
    _partial_index("ix_inbox_messages_pending_type", pending, *by_type)
    leased = pending & inbox.c.locked_until.is_not(None)
    _partial_index("ix_inbox_messages_leased", leased, inbox.c.routing_key)
    # `status`: the newest processed row, and the count of processed rows, read from this
    # narrow index (the newest: one entry per partition) instead of from every finished row.
    processed = inbox.c.status == PROCESSED
    _partial_index("ix_inbox_messages_processed", processed, inbox.c.processed_at)
    # Dead-letter groups: GROUP BY fingerprint reads this index alone on PostgreSQL.
    _partial_index(
        "ix_inbox_messages_dead_fingerprint",
        inbox.c.status == DEAD,
        inbox.c.fingerprint,
        postgresql_include=["routing_key", "processed_at", "received_at", "replays"],
    )
    return inbox


def _deliveries_table(metadata: MetaData) -> Table:
    """The count of deliveries of each received message."""
    return Table(
        "inbox_deliveries",
        metadata,
        Column("message_id", Uuid(as_uuid=True), primary_key=True),
        Column("deliveries", Integer, nullable=False, server_default=text("0")),
        Column("first_seen_at", _Time, nullable=False, server_default=func.now()),
        Column("last_seen_at", _Time, nullable=False, server_default=func.now()),
        # Deliveries dropped because the message was already stored: the duplicates the
        # inbox absorbed. The audit reports them.
        Column("duplicates", Integer, nullable=False, server_default=text("0")),
    )


def _subscriptions_table(metadata: MetaData) -> Table:
    """What the service's inbox queue is bound to, and since when (the database clock at its
    first declaration). The audit expects an event at a service only if it was published
    after the service subscribed to it."""
    return Table(
        "subscriptions",
        metadata,
        Column("service", String(255), primary_key=True),
        Column("exchange", String(255), primary_key=True),
        Column("pattern", String(255), primary_key=True),
        Column("subscribed_at", _Time, nullable=False, server_default=func.now()),
    )


def _archive_files_table(metadata: MetaData) -> Table:
    """The Parquet files `outbox-inbox archive` is writing. A row is committed before its file
    is written and deleted in the transaction that deletes the file's rows from the hot
    table, so a row left behind names a file whose batch did not finish (archive.py)."""
    return Table(
        "archive_files",
        metadata,
        Column("id", Uuid(as_uuid=True), primary_key=True),
        Column("source_table", String(16), nullable=False),
        Column("path", Text, nullable=False),
        Column("created_at", _Time, nullable=False, server_default=func.now()),
        CheckConstraint("source_table IN ('outbox', 'inbox')", name="source_table"),
    )


def _instances_table(metadata: MetaData) -> Table:
    """The running workers of each service and what they handle (rolling deploys): one row per
    worker, upserted while it runs (`queries.roles.advertise_instance`) and deleted when it
    stops. `handlers`: a JSON list of {"kind", "pattern", "versions"} (versions null: every
    version). A row whose `seen_at` is older than `no_handler_grace` is a worker that died."""
    return Table(
        "instances",
        metadata,
        Column("service", String(255), primary_key=True),
        Column("instance", String(255), primary_key=True),
        Column("handlers", _Json, nullable=False),
        Column("started_at", _Time, nullable=False, server_default=func.now()),
        Column("seen_at", _Time, nullable=False, server_default=func.now()),
    )
