"""The audit: a PySpark job that reconciles every service's sent messages with their receipts.

Input: archive roots written by `outbox-inbox archive` (any path Spark reads: a local
directory, ``hdfs://``, ``s3a://``), and optionally the live tables of service databases.
Output: the summary described in docs/history.md (a JSON-ready dict).

What is expected where:

* a published **command** ``<consumer>.<entity>.<verb>`` is expected once at ``<consumer>``;
* a published **event** is expected once at each service with a recorded subscription whose
  topic pattern matches its routing key, when the event was published at or after the time the
  service subscribed (``subscriptions.subscribed_at``);
* an expected delivery with no inbox row is **lost**, unless it was published after the
  horizon (now minus the grace period): then it is **in flight**;
* two inbox rows of one message at one service mean it was **handled more than once** (a
  duplicate that arrived after the first copy left the inbox: the retention was too short);
* deliveries the inbox dropped as duplicates (``inbox_deliveries.duplicates``) are
  **duplicates absorbed**: the at-least-once wire doing its job.

The job uses DataFrame operations only (no Python UDFs), so executors need nothing but Spark:
the same code runs on ``local[*]`` and on a cluster. Topic patterns are matched on the driver
against the distinct routing keys, with the matcher the in-memory broker uses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..archive import COLUMNS, INBOX, OUTBOX, SUBSCRIPTIONS, subscription_record, to_records
from ..errors import ConfigurationError, OutboxInboxError
from ..messages import EVENTS_EXCHANGE
from ..topology import topic_matches

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Row, SparkSession
    from pyspark.sql.types import StructType

SCHEMA_VERSION = 1
EXAMPLES = 100  # lost and doubly handled messages listed by id in the summary
STAGES = ("publish", "transit", "processing", "end_to_end")
# Throughput buckets: the smallest that gives at most MAX_BUCKETS points over the window.
BUCKET_STEPS = (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 10800, 21600, 43200, 86400, 604800)
MAX_BUCKETS = 240
# End-to-end latency histogram: four buckets per decade, from 1 ms to about 3 hours.
HISTOGRAM_PER_DECADE = 4
HISTOGRAM_LOW, HISTOGRAM_HIGH = -3 * HISTOGRAM_PER_DECADE, 4 * HISTOGRAM_PER_DECADE


class AuditError(OutboxInboxError):
    """The audit could not run."""


def require_pyspark() -> Any:
    """Import pyspark, or raise ConfigurationError naming the extra that installs it."""
    try:
        import pyspark
    except ImportError as exc:
        raise ConfigurationError(
            "the audit needs PySpark and Java 17+: pip install 'outbox-inbox[spark]'"
        ) from exc
    return pyspark


@dataclass(frozen=True)
class LiveRows:
    """Rows read from one service's live tables (outbox and inbox records as archived)."""

    service: str
    outbox: list[dict[str, Any]]
    inbox: list[dict[str, Any]]
    subscriptions: list[dict[str, Any]]


def spark_session(
    master: str | None = None,
    *,
    driver_memory: str | None = None,
    config: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for the audit.

    `master` None means: the master spark-submit configured, else ``local[*]``. A local master
    gets a small shuffle width and no UI; a cluster's own configuration is left alone. The
    session's time zone is UTC, so time buckets and dates do not depend on the host.
    """
    require_pyspark()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("outbox-inbox audit")
    # spark-submit starts the JVM first and hands the driver its gateway (and its master).
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[*]"
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        # A local Spark serves its blocks on loopback only, not on the host's address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (
            builder.config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "8")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
        )
        if driver_memory:
            builder = builder.config("spark.driver.memory", driver_memory)
    builder = builder.config("spark.sql.session.timeZone", "UTC").config(
        "spark.sql.sources.partitionColumnTypeInference.enabled", "false"
    )
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # pyspark raises plain or py4j errors: no narrower class to catch
        raise AuditError(
            f"could not start Spark (master {master or 'from spark-submit'}; the audit needs "
            f"Java 17+ on PATH or JAVA_HOME): {_first_line(exc)}"
        ) from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


# --- reading ------------------------------------------------------------------------------


def spark_schema(source: str, *, partitioned: bool) -> StructType:
    """The Spark schema of an archived `source`, with the ``service`` (and ``date``)
    partition columns when `partitioned`."""
    from pyspark.sql import types as T

    kinds = {
        "int64": T.LongType(),
        "int32": T.IntegerType(),
        "string": T.StringType(),
        "timestamp": T.TimestampType(),
    }
    fields = [T.StructField(name, kinds[kind], True) for name, kind in COLUMNS[source]]
    if partitioned:
        fields.append(T.StructField("service", T.StringType(), True))
        if source != SUBSCRIPTIONS:
            fields.append(T.StructField("date", T.StringType(), True))
    return T.StructType(fields)


def read_archives(spark: SparkSession, roots: Sequence[str], source: str) -> DataFrame:
    """Every archive root's `source` files as one DataFrame (empty when there are none)."""
    from pyspark.errors import AnalysisException

    schema = spark_schema(source, partitioned=True)
    frames = []
    for root in roots:
        path = f"{root.rstrip('/')}/{source}"
        try:
            frames.append(spark.read.schema(schema).parquet(path))
        except AnalysisException as exc:
            if "PATH_NOT_FOUND" not in str(exc) and "does not exist" not in str(exc):
                raise
    frame = spark.createDataFrame([], schema)
    for other in frames:
        frame = frame.unionByName(other)
    return frame


def live_frame(spark: SparkSession, source: str, live: Sequence[LiveRows]) -> DataFrame | None:
    """The live rows of `source` as a DataFrame shaped like the archive's, or None."""
    schema = spark_schema(source, partitioned=True)
    rows = []
    names = [f.name for f in schema.fields]
    for part in live:
        for record in getattr(part, source):
            values = dict(record, service=part.service, date=None)
            rows.append(tuple(values.get(n) for n in names))
    return spark.createDataFrame(rows, schema) if rows else None


def read_live(db_url: str, schema: str | None = None) -> LiveRows:
    """Read one service's live outbox, inbox and subscriptions (the service is the one its
    subscriptions name). Raises ConfigurationError when that is not exactly one service."""
    from sqlalchemy import create_engine

    from .. import queries
    from ..logsafe import mask_url
    from ..sqlite import is_sqlite
    from ..tables import build_tables

    tables = build_tables(None if is_sqlite(db_url) else (schema or "outbox_inbox"))
    engine = create_engine(db_url)
    read_at = datetime.now(UTC)
    try:
        with engine.connect() as conn:
            subscriptions = queries.subscriptions_of(conn, tables)
            services = sorted({row["service"] for row in subscriptions})
            if len(services) != 1:
                raise ConfigurationError(
                    f"cannot tell which service {mask_url(db_url)} belongs to: its "
                    f"subscriptions table names {len(services)} services ({services})"
                )
            return LiveRows(
                service=services[0],
                # Stamped as archived now: newer than any archived copy of the same row.
                outbox=to_records(OUTBOX, queries.history_rows(conn, tables, OUTBOX), read_at),
                inbox=to_records(INBOX, queries.history_rows(conn, tables, INBOX), read_at),
                subscriptions=[subscription_record(row) for row in subscriptions],
            )
    finally:
        engine.dispose()


# --- the audit ----------------------------------------------------------------------------


def run_audit(
    spark: SparkSession,
    archives: Sequence[str],
    *,
    live: Sequence[LiveRows] = (),
    grace: timedelta = timedelta(minutes=5),
    now: datetime | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Reconcile the message history; return the summary (see the module docstring).

    Reads but never writes the archives. Raises pyspark's errors when Spark fails.
    """
    from pyspark.sql import functions as F

    now = now or datetime.now(UTC)
    horizon = now - grace
    outbox, inbox, subscriptions = _read_inputs(spark, archives, live)
    published = outbox.where(F.col("published_at").isNotNull())
    expected = _expected_deliveries(spark, published, subscriptions)
    joined = _reconcile(expected, _received(inbox))
    totals_out, totals_in = _outbox_totals(outbox), _delivery_totals(joined, horizon)
    totals = {k: int(totals_out[k] or 0) for k in _OUT_COUNTS} | {
        k: int(totals_in[k] or 0) for k in _IN_COUNTS
    }
    is_expected, is_received, _, lost = _delivery_states(horizon)
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "generated_at": _iso(now),
        "ok": totals["lost"] == 0 and totals["handled_more_than_once"] == 0,
        "inputs": _inputs(spark, archives, grace, horizon, inputs or {}),
        "window": {
            "first_created_at": _iso(totals_out["first_created_at"]),
            "last_processed_at": _iso(totals_in["last_processed_at"]),
        },
        "totals": totals,
        "services": _services(outbox, joined, is_expected, is_received, lost),
        **_examples(joined, lost),
        "latency": _latency(joined),
        "latency_histogram": _histogram(joined),
        "retries": _retries(joined),
        **_dead_letters(joined),
        "throughput": _throughput(outbox, joined, *_throughput_window(totals_out, totals_in)),
    }
    joined.unpersist()
    outbox.unpersist()
    return summary


def _inputs(
    spark: SparkSession,
    archives: Sequence[str],
    grace: timedelta,
    horizon: datetime,
    inputs: Mapping[str, Any],
) -> dict[str, Any]:
    """The summary's ``inputs``: what was read, where, and the grace; `inputs` adds to it."""
    return {
        "archives": list(archives),
        "live_databases": [],
        "master": spark.sparkContext.master,
        "grace_seconds": grace.total_seconds(),
        "horizon": _iso(horizon),
        **inputs,
    }


def _read_inputs(
    spark: SparkSession, archives: Sequence[str], live: Sequence[LiveRows]
) -> tuple[DataFrame, DataFrame, list[tuple[str, str, str, datetime | None]]]:
    """The sent messages (persisted: the caller unpersists them), the inbox rows, and every
    subscription as (service, exchange, pattern, subscribed_at), from archives and live rows."""
    from pyspark import StorageLevel

    # Only the columns the audit uses: payloads and headers never enter a shuffle.
    outbox = read_archives(spark, archives, OUTBOX).select(*_OUTBOX_USED)
    inbox = read_archives(spark, archives, INBOX).select(*_INBOX_USED)
    subs = read_archives(spark, archives, SUBSCRIPTIONS)
    live_outbox, live_inbox = live_frame(spark, OUTBOX, live), live_frame(spark, INBOX, live)
    if live_outbox is not None:
        outbox = outbox.unionByName(live_outbox.select(*_OUTBOX_USED))
    if live_inbox is not None:
        inbox = inbox.unionByName(live_inbox.select(*_INBOX_USED))
    subscriptions = [
        (row["service"], row["exchange"], row["pattern"], _aware(row["subscribed_at"]))
        for row in subs.collect()
    ] + [
        (part.service, s["exchange"], s["pattern"], _aware(s["subscribed_at"]))
        for part in live
        for s in part.subscriptions
    ]

    # One row per sent message. The archive writes a row once; only a row archived while the
    # audit read the live tables can be in both.
    if live_outbox is not None:
        outbox = outbox.dropDuplicates(["service", "message_id"])
    outbox = outbox.withColumnRenamed("service", "producer").persist(StorageLevel.MEMORY_AND_DISK)
    return outbox, inbox, subscriptions


def _expected_deliveries(
    spark: SparkSession,
    published: DataFrame,
    subscriptions: Iterable[tuple[str, str, str, datetime | None]],
) -> DataFrame:
    """One row per (consumer, message) the published messages were expected at."""
    from pyspark.sql import functions as F

    # Expected deliveries: commands at the service their routing key names, events at every
    # subscriber whose pattern matches and who subscribed before the publication.
    commands = published.where(F.col("kind") == "command").withColumn(
        "consumer", F.substring_index("routing_key", ".", 1)
    )
    event_keys = [
        r["routing_key"]
        for r in published.where(F.col("kind") == "event")
        .select("routing_key")
        .distinct()
        .collect()
    ]
    matches = _event_matches(event_keys, subscriptions)
    match_schema = "routing_key string, consumer string, subscribed_at timestamp"
    events = (
        published.where(F.col("kind") == "event")
        .join(F.broadcast(spark.createDataFrame(matches, match_schema)), "routing_key")
        .where(F.col("published_at") >= F.col("subscribed_at"))
        .drop("subscribed_at")
    )
    expected_columns = [
        "message_id",
        "routing_key",
        "kind",
        "producer",
        "consumer",
        "created_at",
        "published_at",
    ]
    return commands.select(*expected_columns).unionByName(events.select(*expected_columns))


def _received(inbox: DataFrame) -> DataFrame:
    """One row per (consumer, message_id) received, with how its handling went."""
    from pyspark.sql import functions as F

    # Received: one row per (consumer, message_id). Copies of one inbox row (a replayed dead
    # row archived twice) collapse to the latest; two inbox rows are two handlings.
    # Partitioned once by (service, message_id): both aggregations below reuse it.
    latest = (
        inbox.repartition("service", "message_id")
        .groupBy("service", "message_id", "id")
        .agg(F.max_by(F.struct(*[c for c in inbox.columns]), "archived_at").alias("r"))
        .select("r.*")
    )
    return latest.groupBy(F.col("service").alias("consumer"), "message_id").agg(
        F.count("*").alias("copies"),
        F.first("routing_key").alias("r_type"),
        F.first("source").alias("r_source"),
        F.max("status").alias("status"),  # "processed" > "pending" > "dead"
        F.min("received_at").alias("received_at"),
        F.min("processed_at").alias("processed_at"),  # the first handling's
        F.max("attempts").alias("attempts"),
        F.max("dead_reason").alias("dead_reason"),
        F.max("last_error").alias("last_error"),
        F.sum("duplicates").alias("duplicates"),
        F.max("deliveries").alias("deliveries"),
    )


def _reconcile(expected: DataFrame, received: DataFrame) -> DataFrame:
    """Expected and received deliveries side by side, persisted (the caller unpersists)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    return (
        expected.withColumn("expected", F.lit(True))
        .join(received.withColumn("got", F.lit(True)), ["consumer", "message_id"], "full_outer")
        .withColumn("type", F.coalesce("routing_key", "r_type"))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )


def _delivery_states(horizon: datetime) -> tuple[Column, Column, Column, Column]:
    """Conditions on a reconciled row: expected, received, missing, lost (missing and
    published before the horizon; a missing delivery published after it is in flight)."""
    from pyspark.sql import functions as F

    is_expected = F.col("expected").isNotNull()
    is_received = F.col("got").isNotNull()
    missing = is_expected & ~is_received
    lost = missing & (F.col("published_at") < F.lit(horizon))
    return is_expected, is_received, missing, lost


def _outbox_totals(outbox: DataFrame) -> Row:
    """The counts of sent messages, and the first and last times of the window."""
    from pyspark.sql import functions as F

    totals_out = outbox.agg(
        F.count("*").alias("sent"),
        F.sum(_flag(F.col("kind") == "command")).alias("commands"),
        F.sum(_flag(F.col("kind") == "event")).alias("events"),
        F.sum(_flag(F.col("published_at").isNotNull())).alias("published"),
        F.sum(_flag(F.col("expired_at").isNotNull())).alias("expired"),
        F.sum(_flag(F.col("published_at").isNull() & F.col("expired_at").isNull())).alias(
            "unpublished"
        ),
        F.sum(F.when(F.col("published_at").isNotNull(), F.col("attempts"))).alias(
            "publish_retries"
        ),
        F.min("created_at").alias("first_created_at"),
        F.min("published_at").alias("first_published_at"),
        F.max("published_at").alias("last_published_at"),
    ).first()
    assert totals_out is not None
    return totals_out


def _delivery_totals(joined: DataFrame, horizon: datetime) -> Row:
    """The counts of deliveries and handlings, and the last time anything was processed."""
    from pyspark.sql import functions as F

    is_expected, is_received, missing, lost = _delivery_states(horizon)
    totals_in = joined.agg(
        F.sum(_flag(is_expected)).alias("expected_deliveries"),
        F.sum(_flag(is_expected & is_received)).alias("delivered"),
        F.sum(_flag(lost)).alias("lost"),
        F.sum(_flag(missing & ~lost)).alias("in_flight"),
        F.sum(F.coalesce("duplicates", F.lit(0))).alias("duplicates_absorbed"),
        F.sum(_flag(F.col("copies") > 1)).alias("handled_more_than_once"),
        F.sum(_flag(~is_expected & is_received)).alias("unexpected"),
        F.sum(_flag(F.col("status") == "processed")).alias("processed"),
        F.sum(_flag(F.col("status") == "pending")).alias("pending"),
        F.sum(_flag(F.col("status") == "dead")).alias("dead"),
        F.sum(_flag(F.col("attempts") > 1)).alias("retried_messages"),
        F.sum(F.greatest(F.col("attempts") - 1, F.lit(0))).alias("retries"),
        F.max("processed_at").alias("last_processed_at"),
    ).first()
    assert totals_in is not None
    return totals_in


def _examples(joined: DataFrame, lost: Column) -> dict[str, list[dict[str, Any]]]:
    """The summary's ``lost`` and ``handled_more_than_once`` lists, EXAMPLES of each."""
    from pyspark.sql import functions as F

    return {
        "lost": [
            {
                "message_id": r["message_id"],
                "type": r["type"],
                "producer": r["producer"],
                "consumer": r["consumer"],
                "published_at": _iso(r["published_at"]),
            }
            for r in joined.where(lost)
            .orderBy("published_at", "message_id")
            .limit(EXAMPLES)
            .collect()
        ],
        "handled_more_than_once": [
            {
                "message_id": r["message_id"],
                "type": r["type"],
                "consumer": r["consumer"],
                "copies": int(r["copies"]),
            }
            for r in joined.where(F.col("copies") > 1)
            .orderBy(F.desc("copies"), "message_id")
            .limit(EXAMPLES)
            .collect()
        ],
    }


def _throughput_window(totals_out: Row, totals_in: Row) -> tuple[datetime | None, datetime | None]:
    """From the first publication to the last publication or processing, whichever is later."""
    last = max(
        (
            t
            for t in (
                _aware(totals_out["last_published_at"]),
                _aware(totals_in["last_processed_at"]),
            )
            if t is not None
        ),
        default=None,
    )
    return _aware(totals_out["first_published_at"]), last


_OUTBOX_USED = (
    "service",
    "message_id",
    "kind",
    "routing_key",
    "created_at",
    "published_at",
    "expired_at",
    "attempts",
)
_INBOX_USED = (
    "service",
    "message_id",
    "id",
    "source",
    "routing_key",
    "status",
    "received_at",
    "processed_at",
    "attempts",
    "dead_reason",
    "last_error",
    "duplicates",
    "deliveries",
    "archived_at",
)
_OUT_COUNTS = (
    "sent",
    "commands",
    "events",
    "published",
    "expired",
    "unpublished",
    "publish_retries",
)
_IN_COUNTS = (
    "expected_deliveries",
    "delivered",
    "lost",
    "in_flight",
    "duplicates_absorbed",
    "handled_more_than_once",
    "unexpected",
    "processed",
    "pending",
    "dead",
    "retried_messages",
    "retries",
)
#: Every count of the summary's ``totals``.
TOTALS = _OUT_COUNTS + _IN_COUNTS


def _event_matches(
    routing_keys: Iterable[str], subscriptions: Iterable[tuple[str, str, str, datetime | None]]
) -> list[tuple[str, str, datetime]]:
    """(routing_key, consumer, subscribed_at) for each event key and each matching subscriber.

    A service subscribed through several matching patterns counts once, from its earliest.
    """
    event_subs = [
        (service, pattern, since)
        for service, exchange, pattern, since in subscriptions
        if exchange == EVENTS_EXCHANGE
    ]
    out: list[tuple[str, str, datetime]] = []
    for key in sorted(set(routing_keys)):
        earliest: dict[str, datetime] = {}
        for service, pattern, since in event_subs:
            if topic_matches(pattern, key):
                start = since or datetime.min.replace(tzinfo=UTC)
                earliest[service] = min(start, earliest.get(service, start))
        out.extend((key, service, since) for service, since in sorted(earliest.items()))
    return out


def _services(
    outbox: DataFrame, joined: DataFrame, is_expected: Column, is_received: Column, lost: Column
) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    sent = {
        r["producer"]: int(r["n"])
        for r in outbox.groupBy("producer").agg(F.count("*").alias("n")).collect()
    }
    rows = (
        joined.groupBy("consumer")
        .agg(
            F.sum(_flag(is_received)).alias("received"),
            F.sum(_flag(F.col("status") == "processed")).alias("processed"),
            F.sum(_flag(F.col("status") == "dead")).alias("dead"),
            F.sum(_flag(lost)).alias("lost"),
            F.sum(F.coalesce("duplicates", F.lit(0))).alias("duplicates_absorbed"),
        )
        .collect()
    )
    by_service = {r["consumer"]: r for r in rows}
    out = []
    for service in sorted(set(sent) | set(by_service)):
        r = by_service.get(service)
        counts = {
            k: int(r[k] or 0) if r is not None else 0
            for k in ("received", "processed", "dead", "lost", "duplicates_absorbed")
        }
        out.append({"service": service, "sent": sent.get(service, 0), **counts})
    return out


def _seconds(later: str, earlier: str) -> Column:
    from pyspark.sql import functions as F

    return (F.unix_micros(F.col(later)) - F.unix_micros(F.col(earlier))) / 1e6


def _latency(joined: DataFrame) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    done = joined.where(F.col("expected").isNotNull() & (F.col("status") == "processed"))
    stage_columns = {
        "publish": _seconds("published_at", "created_at"),
        "transit": _seconds("received_at", "published_at"),
        "processing": _seconds("processed_at", "received_at"),
        "end_to_end": _seconds("processed_at", "created_at"),
    }
    aggregates = [F.count("*").alias("count")]
    for stage, column in stage_columns.items():
        aggregates.append(F.percentile_approx(column, [0.5, 0.9, 0.99], 10000).alias(f"{stage}_p"))
        aggregates.append(F.max(column).alias(f"{stage}_max"))
    out = []
    for r in done.groupBy("type").agg(*aggregates).orderBy("type").collect():
        stages = {}
        for stage in STAGES:
            p = r[f"{stage}_p"] or [None, None, None]
            stages[stage] = {
                "p50": _float(p[0]),
                "p90": _float(p[1]),
                "p99": _float(p[2]),
                "max": _float(r[f"{stage}_max"]),
            }
        out.append({"type": r["type"], "count": int(r["count"]), "stages": stages})
    return out


def _histogram(joined: DataFrame) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    seconds = _seconds("processed_at", "created_at")
    bucket = F.when(
        seconds <= 10.0 ** (HISTOGRAM_LOW / HISTOGRAM_PER_DECADE), HISTOGRAM_LOW
    ).otherwise(
        F.least(
            F.ceil(F.log10(seconds) * HISTOGRAM_PER_DECADE),
            F.lit(HISTOGRAM_HIGH + 1),
        )
    )
    counts = {
        int(r["b"]): int(r["n"])
        for r in joined.where(F.col("expected").isNotNull() & (F.col("status") == "processed"))
        .where(seconds.isNotNull())
        .groupBy(bucket.alias("b"))
        .agg(F.count("*").alias("n"))
        .collect()
    }
    if not counts:
        return []
    low, high = min(counts), max(counts)
    return [
        {
            "le_seconds": None
            if b > HISTOGRAM_HIGH
            else round(10 ** (b / HISTOGRAM_PER_DECADE), 6),
            "count": counts.get(b, 0),
        }
        for b in range(low, high + 1)
    ]


def _retries(joined: DataFrame) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    rows = (
        joined.where(F.col("got").isNotNull())
        .groupBy("type")
        .agg(
            F.count("*").alias("messages"),
            F.sum(_flag(F.col("attempts") > 1)).alias("retried_messages"),
            F.sum(F.greatest(F.col("attempts") - 1, F.lit(0))).alias("retries"),
            F.max("attempts").alias("max_attempts"),
        )
        .orderBy(F.desc("retries"), "type")
        .collect()
    )
    return [
        {
            "type": r["type"],
            "messages": int(r["messages"]),
            "retried_messages": int(r["retried_messages"] or 0),
            "retries": int(r["retries"] or 0),
            "max_attempts": int(r["max_attempts"] or 0),
        }
        for r in rows
    ]


def _dead_letters(joined: DataFrame) -> dict[str, list[dict[str, Any]]]:
    from pyspark.sql import functions as F

    # The last line of a stored traceback is the exception itself ("ValueError: bad").
    error = F.substring(
        F.element_at(F.split(F.trim(F.coalesce("last_error", F.lit(""))), "\n"), -1), 1, 200
    )
    dead = joined.where(F.col("status") == "dead").withColumn("error", error)
    by_type = (
        dead.groupBy("type", F.coalesce("dead_reason", F.lit("unknown")).alias("reason"))
        .agg(F.count("*").alias("count"), F.min("error").alias("example_error"))
        .orderBy(F.desc("count"), "type", "reason")
        .collect()
    )
    causes = (
        dead.groupBy(F.coalesce("dead_reason", F.lit("unknown")).alias("reason"), "error")
        .agg(F.count("*").alias("count"))
        .orderBy(F.desc("count"), "reason", "error")
        .limit(10)
        .collect()
    )
    return {
        "dead_letters": [
            {
                "type": r["type"],
                "reason": r["reason"],
                "count": int(r["count"]),
                "example_error": r["example_error"] or "",
            }
            for r in by_type
        ],
        "dead_letter_causes": [
            {"reason": r["reason"], "error": r["error"] or "", "count": int(r["count"])}
            for r in causes
        ],
    }


def _throughput(
    outbox: DataFrame, joined: DataFrame, start: datetime | None, end: datetime | None
) -> dict[str, Any]:
    from pyspark.sql import functions as F

    if start is None or end is None:
        return {"bucket_seconds": None, "series": []}
    span = max((end - start).total_seconds(), 1.0)
    step = next((s for s in BUCKET_STEPS if span / s <= MAX_BUCKETS), BUCKET_STEPS[-1])

    def per_bucket(frame: DataFrame, column: str) -> dict[int, int]:
        b = (F.floor(F.unix_seconds(F.col(column)) / step) * step).cast("long")
        rows = (
            frame.where(F.col(column).isNotNull())
            .groupBy(b.alias("b"))
            .agg(F.count("*").alias("n"))
            .collect()
        )
        return {int(r["b"]): int(r["n"]) for r in rows}

    sent = per_bucket(outbox, "published_at")
    done = per_bucket(joined.where(F.col("status") == "processed"), "processed_at")
    if not sent and not done:
        return {"bucket_seconds": step, "series": []}
    first, last = min(sent.keys() | done.keys()), max(sent.keys() | done.keys())
    series = [
        {
            "start": _iso(datetime.fromtimestamp(b, UTC)),
            "published": sent.get(b, 0),
            "processed": done.get(b, 0),
        }
        for b in range(first, last + 1, step)
    ]
    return {"bucket_seconds": step, "series": series}


# --- small conversions --------------------------------------------------------------------


def _flag(condition: Column) -> Column:
    from pyspark.sql import functions as F

    return F.when(condition, 1).otherwise(0)


def _aware(value: Any) -> datetime | None:
    """Spark returns naive datetimes in the session time zone (UTC)."""
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _iso(value: Any) -> str | None:
    aware = _aware(value)
    return aware.isoformat() if aware is not None else None


def _float(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(float(value), 6)


__all__ = [
    "AuditError",
    "LiveRows",
    "read_archives",
    "read_live",
    "run_audit",
    "spark_session",
]
