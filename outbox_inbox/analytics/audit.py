"""The audit: a PySpark job that reconciles every service's sent messages with their receipts. It
reads archive roots written by `outbox-inbox archive` (any path Spark reads) and optionally the live
tables of service databases, and returns the summary of docs/history.md ("The audit"; "How the job
runs": DataFrame operations only, no Python UDFs)."""

from __future__ import annotations

import math
import operator
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..archive import COLUMNS, INBOX, OUTBOX, SUBSCRIPTIONS, subscription_record, to_records
from ..errors import ConfigurationError, OutboxInboxError
from ..messages import EVENTS_EXCHANGE
from ..tables import WEBHOOK

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Row, SparkSession
    from pyspark.sql.types import StructType

SCHEMA_VERSION = 1
EXAMPLES = 100  # lost and doubly handled messages listed by id in the summary
STAGES = ("publish", "transit", "processing", "end_to_end")
PERCENTILES = ("p50", "p90", "p99", "max")  # of each stage's latency, per type
# Throughput buckets: the smallest that gives at most MAX_BUCKETS points over the window.
BUCKET_STEPS = (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 10800, 21600, 43200, 86400, 604800)
MAX_BUCKETS = 240
# Spark's estimate of the compressed columns read, per part the receipts are spread into.
PART_BYTES = 8 * 1024 * 1024
# End-to-end latency histogram: four buckets per decade, from 1 ms to about 3 hours.
HISTOGRAM_PER_DECADE = 4
HISTOGRAM_LOW, HISTOGRAM_HIGH = -3 * HISTOGRAM_PER_DECADE, 4 * HISTOGRAM_PER_DECADE
# Day results (`keep`): latencies in buckets each RATIO wider than the last (a percentile within
# 1% of its value), throughput in buckets of at most FINE seconds (any step of 2 days or more).
RATIO, FINE = 1.02, 600


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
    log: Path | None = None,
) -> SparkSession:
    """A SparkSession for the audit on `master`, else spark-submit's, else ``local[*]`` (no UI,
    a small shuffle width; a cluster's configuration is left alone), in the UTC time zone. With
    `log`, Spark's own output goes to that file, not to this process's stderr."""
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
    builder = (
        builder.config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.sql.adaptive.enabled", "true")
        # No Python call site recorded in the JVM for each call: half the audit's py4j round trips.
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
        # The receipts are spread by message id alone; the join on (message id, consumer)
        # may reuse that spreading rather than spread them again.
        .config("spark.sql.requireAllClusterKeysForCoPartition", "false")
    )
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    try:
        with _stderr_to(log):
            spark = builder.getOrCreate()
    except Exception as exc:  # pyspark raises plain or py4j errors: no narrower class to catch
        raise AuditError(
            f"could not start Spark (master {master or 'from spark-submit'}; the audit needs "
            f"Java 17+ on PATH or JAVA_HOME): {_first_line(exc)}"
            + (f" (Spark's output: {log})" if log else "")
        ) from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextmanager
def _stderr_to(log: Path | None) -> Iterator[None]:
    """Standard error (fd 2) sent to `log` meanwhile: a JVM started meanwhile keeps it for life."""
    if log is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("ab") as out:
        os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def spark_schema(source: str, *, partitioned: bool) -> StructType:
    """The Spark schema of an archived `source`, with its partition columns if `partitioned`."""
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
    from ..database import DEFAULT_SCHEMA, connect
    from ..logsafe import mask_url
    from ..queries import archive, operations

    database = connect(db_url, schema or DEFAULT_SCHEMA)
    engine, tables = database.engine, database.tables
    read_at = datetime.now(UTC)
    try:
        with engine.connect() as conn:
            subscriptions = operations.subscriptions_of(conn, tables)
            services = sorted({row["service"] for row in subscriptions})
            if len(services) != 1:
                raise ConfigurationError(
                    f"cannot tell which service {mask_url(db_url)} belongs to: its "
                    f"subscriptions table names {len(services)} services ({services})"
                )
            return LiveRows(
                service=services[0],
                # Stamped as archived now: newer than any archived copy of the same row.
                outbox=to_records(OUTBOX, archive.history_rows(conn, tables, OUTBOX), read_at),
                inbox=to_records(INBOX, archive.history_rows(conn, tables, INBOX), read_at),
                subscriptions=[subscription_record(row) for row in subscriptions],
            )
    finally:
        engine.dispose()


@dataclass(frozen=True)
class Window:
    """The messages an incremental audit covers: those published in ``[since, until)`` (an
    unpublished one by its creation, a receipt of nobody's message by its message's creation).
    The archive dates rows by when they became visible (`DATE_COLUMNS`), so only the date
    partitions from `since` on are read, and of them only the rows of messages created before
    `until` (docs/history.md, "One day at a time"): no row is left unread, however late."""

    since: datetime
    until: datetime

    def __post_init__(self) -> None:
        if self.since.tzinfo is None or self.until.tzinfo is None:
            raise ConfigurationError("the audit window's times must be timezone-aware")
        if self.until <= self.since:
            raise ConfigurationError(
                f"the audit window is empty: --until {self.until.isoformat()} is not after "
                f"--since {self.since.isoformat()}"
            )

    def days(self) -> list[str]:
        """The window's days (``YYYY-MM-DD``, UTC): those and the later ones are read."""
        first = self.since.astimezone(UTC).date()
        last = (self.until - timedelta(microseconds=1)).astimezone(UTC).date()
        return [(first + timedelta(days=n)).isoformat() for n in range((last - first).days + 1)]

    def read(self) -> Column:
        """The rows read: those of messages created before `until` (or of no known time)."""
        from pyspark.sql import functions as F

        return F.col("created_at").isNull() | (F.col("created_at") < F.lit(self.until))

    def describe(self) -> dict[str, Any]:
        return {"since": _iso(self.since), "until": _iso(self.until)}


def run_audit(
    spark: SparkSession,
    archives: Sequence[str],
    *,
    live: Sequence[LiveRows] = (),
    grace: timedelta = timedelta(minutes=5),
    now: datetime | None = None,
    inputs: Mapping[str, Any] | None = None,
    window: Window | None = None,
    keep: bool = False,
) -> dict[str, Any]:
    """Reconcile the message history; return the summary (docs/history.md). With `window`,
    only that window's messages (see `Window`). With `keep`, the summary's ``parts`` are what
    `combine` makes it again from, alone or with other windows'. Reads but never writes the
    archives. Raises AuditError when a window's days are in no archive and no live rows were
    given, pyspark's errors when Spark fails."""
    now = now or datetime.now(UTC)
    horizon = now - grace
    outbox, inbox, subscriptions = _read_inputs(spark, archives, live, window)
    parts = _parts(spark, outbox, inbox)
    rows = _reconcile(_expected(outbox, subscriptions), _received(inbox, parts), window)
    rows = _kept(spark, rows)
    try:
        found = _aggregate(rows, horizon, keep)
        figures = _Figures(found)
        step = _step(figures.first_published_at, figures.last_at())
        if step is not None and step < FINE:  # a span under 20 hours: counted again, finer
            finer = [r.asDict() for r in _buckets(rows, step).collect()]
            found = [r for r in found if r[_SET] != "t"] + finer
        inputs = {  # what was read, where, and the grace; `inputs` adds to it
            "archives": list(archives),
            "live_databases": [],
            "master": spark.conf.get("spark.master"),
            "grace_seconds": grace.total_seconds(),
            "horizon": _iso(horizon),
            **({"window": window.describe()} if window is not None else {}),
            **(inputs or {}),
        }
        summary = _summary(_iso(now), inputs, figures, _Details(found, step))
    finally:
        rows.unpersist()
    if keep:
        summary["parts"] = found
    return summary


def combine(
    parts: Sequence[Mapping[str, Any]], generated_at: str, inputs: Mapping[str, Any]
) -> dict[str, Any]:
    """The summary of the windows whose `parts` (``run_audit(keep=True)``'s, times as ISO text
    or datetimes) are given together, reading no row: every count exactly the audit's of those
    windows together, the latency percentiles within 1% of their value (`RATIO`); each window
    as judged when its parts were made."""
    figures = _Figures(parts)
    step = _step(figures.first_published_at, figures.last_at())
    return _summary(generated_at, dict(inputs), figures, _Details(parts, step and max(step, FINE)))


def _from_buckets(counts: Counter[int], p: float) -> float | None:
    """The `p` percentile of latencies counted by `_latency_bucket`, within 1% of its value."""
    rank, seen = max(1, math.ceil(p * sum(counts.values()))), 0
    for b in sorted(counts):
        seen += counts[b]
        if seen >= rank:
            return 0.0 if b == 0 else math.copysign(1e-6 * RATIO ** (abs(b) - 1.5), b)
    return None


def _summary(
    generated_at: str | None, inputs: dict[str, Any], figures: _Figures, details: _Details
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": generated_at,
        "ok": figures.totals["lost"] == 0 and figures.totals["handled_more_than_once"] == 0,
        "inputs": inputs,
        "window": {
            "first_created_at": _iso(figures.first_created_at),
            "last_processed_at": _iso(figures.last_processed_at),
        },
        "totals": figures.totals,
        "services": figures.services(),
        "lost": details.lost(),
        "handled_more_than_once": details.handled_more_than_once(),
        "latency": figures.latency(),
        "latency_histogram": figures.histogram(),
        "retries": figures.retries(),
        **figures.dead_letters(),
        "throughput": details.throughput(),
    }


def _kept(spark: SparkSession, rows: DataFrame) -> DataFrame:
    """`rows` kept in memory (spilling to disk) for the jobs after the first, uncompressed:
    compressing the columns costs more than reading them back saves."""
    setting = "spark.sql.inMemoryColumnarStorage.compressed"
    before = spark.conf.get(setting, None)
    spark.conf.set(setting, "false")
    try:
        return rows.persist()
    finally:
        if before is None:
            spark.conf.unset(setting)
        else:
            spark.conf.set(setting, before)


def _read_inputs(
    spark: SparkSession, archives: Sequence[str], live: Sequence[LiveRows], window: Window | None
) -> tuple[DataFrame, DataFrame, list[tuple[str, str, str, datetime | None]]]:
    """The sent messages, the inbox rows, and every subscription as (service, exchange,
    pattern, subscribed_at), from archives and live rows."""
    # Only the columns the audit uses: payloads and headers are never read.
    found = {}
    frames = {}
    for source, used in ((OUTBOX, _OUTBOX_USED), (INBOX, _INBOX_USED)):
        first = window.days()[0] if window is not None else None
        frame, found[source] = _read(spark, archives, source, first)
        extra = live_frame(spark, source, live)
        if extra is not None:
            frame = frame.unionByName(extra)
        if source == OUTBOX:  # webhook deliveries (webhooks.py) are not messages
            frame = frame.where(~frame["exchange"].startswith(WEBHOOK))
        frames[source] = frame.select(*used)
        if window is not None:
            frames[source] = frames[source].where(window.read())
    if window is not None and not any(found.values()) and not live:
        raise AuditError(_unarchived(window, archives))
    archived = read_archives(spark, archives, SUBSCRIPTIONS).collect()
    named: list[tuple[str, Any]] = [(row["service"], row) for row in archived]
    named += [(part.service, s) for part in live for s in part.subscriptions]
    subscriptions = [(n, s["exchange"], s["pattern"], _aware(s["subscribed_at"])) for n, s in named]
    outbox = frames[OUTBOX]
    # One row per sent message. The archive writes a row once; only a row archived while the
    # audit read the live tables can be in both.
    if any(part.outbox for part in live):
        outbox = outbox.dropDuplicates(["service", "message_id"])
    return outbox.withColumnRenamed("service", "producer"), frames[INBOX], subscriptions


def _read(
    spark: SparkSession, roots: Sequence[str], source: str, first: str | None
) -> tuple[DataFrame, bool]:
    """`source`'s files of every root (from day `first` on, if given), and whether any had any."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    schema = spark_schema(source, partitioned=True)
    frames = []
    for root in roots:
        base = f"{root.rstrip('/')}/{source}"
        reader = spark.read.schema(schema).option("basePath", base)
        paths = _listed(base, first)
        if paths is not None:  # a local root, listed here: Spark reads what is there
            frames.extend([reader.parquet(*paths)] if paths else [])
            continue
        try:
            frame = reader.parquet(base)
            if first is not None:  # partition pruning: Spark lists, reads only those days
                frame = frame.where(F.col("date") >= F.lit(first))
            frames.append(frame.select(*frame.columns))  # .columns: analysed on Spark Connect too
        except AnalysisException as exc:
            if "PATH_NOT_FOUND" not in str(exc) and "does not exist" not in str(exc):
                raise
    if not frames:
        return spark.createDataFrame([], schema), False
    return reduce(lambda a, b: a.unionByName(b), frames), True


def _listed(base: str, first: str | None) -> list[str] | None:
    """The directories of a local archive root's `base` (``ROOT/SOURCE``) to read: itself, or
    its date partitions from day `first` on; None for a root elsewhere (Spark lists it)."""
    if "://" in base:
        return None
    if first is None:
        return [base] if Path(base).is_dir() else []
    return sorted(str(p) for p in Path(base).glob("service=*/date=*") if p.name >= f"date={first}")


def check_archives(roots: Sequence[str], window: Window | None, live: bool = False) -> None:
    """What can be told before Spark starts: AuditError when a local root cannot be listed, or
    when `window`'s days are in no partition of the (all local) roots and no `live` rows are."""
    for root in (r for r in roots if "://" not in r):
        try:
            os.listdir(root)
        except OSError as exc:
            raise AuditError(f"archive {root} cannot be read: {exc.strerror or exc}") from None
    if window is None or live or any("://" in root for root in roots):
        return
    if not any(_listed(f"{r}/{s}", window.days()[0]) for r in roots for s in (OUTBOX, INBOX)):
        raise AuditError(_unarchived(window, roots))


def _unarchived(window: Window, roots: Sequence[str]) -> str:
    return (
        f"no archive partition holds the day {window.days()[0]} or a later one in "
        f"{', '.join(roots)}: has that time been archived (outbox-inbox archive)?"
    )


def read_archives(spark: SparkSession, roots: Sequence[str], source: str) -> DataFrame:
    """Every archive root's `source` files as one DataFrame (empty when there are none)."""
    return _read(spark, roots, source, None)[0]


def topic_regex(pattern: str) -> str:
    """A Java regular expression that matches ``"." + routing_key`` exactly when the AMQP topic
    `pattern` matches ``routing_key`` (as `topic_matches` decides)."""
    parts: list[str] = []
    for word in pattern.split("."):
        if word == "#":
            if parts and parts[-1] == r"(\.[^.]*)*":
                continue  # "#.#" matches what "#" matches
            parts.append(r"(\.[^.]*)*")
        elif word == "*":
            parts.append(r"\.[^.]*")
        else:
            literal = "".join("\\" + c if c.isascii() and not c.isalnum() else c for c in word)
            parts.append(r"\." + literal)
    return "^" + "".join(parts) + "$"


def _expected(
    sent: DataFrame, subscriptions: Iterable[tuple[str, str, str, datetime | None]]
) -> DataFrame:
    """The sent messages expanded to one row per expected delivery, with a ``consumer``: a
    published command at the service its routing key names, a published event at every
    service one of whose patterns matches it and which subscribed by its publication. A
    message expected nowhere keeps one row with no consumer; the first row of each message
    is its ``sent_row``, which carries the outbox's figures."""
    from pyspark.sql import functions as F

    key = F.concat(F.lit("."), F.col("routing_key"))
    published_at = F.col("published_at")
    by_service: dict[str, list[Column]] = {}
    for service, exchange, pattern, since in subscriptions:
        if exchange == EVENTS_EXCHANGE:
            condition = key.rlike(topic_regex(pattern))
            if since is not None:
                condition = condition & (published_at >= F.lit(since))
            by_service.setdefault(service, []).append(condition)
    matching = [
        F.when(reduce(operator.or_, conditions), F.lit(service))
        for service, conditions in sorted(by_service.items())
    ]
    # Arrays with a null where a service is not expected: a message keeps its first row (its
    # sent row) and the rows of its consumers. No lambdas: they would stop code generation.
    nobody = F.array(F.lit(None).cast("string"))
    consumers = (
        F.when(published_at.isNull(), nobody)
        .when(F.col("kind") == "command", F.array(F.substring_index("routing_key", ".", 1)))
        .when(F.col("kind") == "event", F.array(*matching) if matching else nobody)
        .otherwise(nobody)
    )
    return (
        sent.select(
            _hash().alias("h"),
            "message_id",
            "routing_key",
            "kind",
            "producer",
            "created_at",
            "published_at",
            "expired_at",
            F.col("attempts").alias("publish_attempts"),
            F.posexplode(consumers).alias("pos", "consumer"),
        )
        .where(F.col("consumer").isNotNull() | (F.col("pos") == 0))
        .select(
            "*",
            (F.col("pos") == 0).alias("sent_row"),
            F.col("consumer").isNotNull().alias("expected"),
        )
    )


def _hash() -> Column:
    """A 64-bit hash of the message id, sorted on first: the ids of one history often share
    a long prefix, which a sort would compare byte by byte."""
    from pyspark.sql import functions as F

    return F.xxhash64("message_id")


def _parts(spark: SparkSession, *inputs: DataFrame) -> int:
    """How many parts to spread the history into by message id: one per PART_BYTES of what
    Spark estimates it reads, at least the parallelism, at most ``spark.sql.shuffle.partitions``
    (not adaptive: Spark keeps the number of parts of a plan it caches as it was planned). On
    Spark Connect (the local warm server), which gives no estimate, from the local files read:
    Spark's estimate of the archive's columns the audit reads is 0.43 of their bytes."""
    most = int(spark.conf.get("spark.sql.shuffle.partitions") or 200)
    try:  # an estimate is an optimisation: without one, Spark's setting rules
        if type(spark).__module__.startswith("pyspark.sql.connect"):
            files = [Path(f.removeprefix("file:")) for df in inputs for f in df.inputFiles()]
            if not all(f.is_file() for f in files):  # an archive elsewhere
                return most
            size, least = 0.43 * sum(f.stat().st_size for f in files), os.cpu_count() or 1
        else:
            plans = [f._jdf.queryExecution().optimizedPlan() for f in inputs]
            size = sum(int(str(p.stats().sizeInBytes())) for p in plans)
            least = spark.sparkContext.defaultParallelism
    except Exception:
        return most
    return max(least, min(most, math.ceil(size / PART_BYTES)))


def _received(inbox: DataFrame, parts: int) -> DataFrame:
    """One row per (consumer, message_id) received, with how its handling went."""
    from pyspark.sql import functions as F

    # Copies of one inbox row (a replayed dead row archived twice) collapse to the latest;
    # two inbox rows are two handlings. Spread by message id once: both aggregations (one
    # sort serves both) and the join with the expected deliveries reuse that spreading.
    keys = ("h", "message_id", "service", "id")
    values = [c for c in inbox.columns if c not in keys]
    latest = (
        inbox.repartition(parts, "message_id")
        .select(_hash().alias("h"), *inbox.columns)
        .groupBy(*keys)
        .agg(F.max_by(F.struct(*values), "archived_at").alias("r"))
        .select(*keys, *(f"r.{c}" for c in values))
    )
    return latest.groupBy("h", "message_id", F.col("service").alias("consumer")).agg(
        F.count("*").alias("copies"),
        F.first("routing_key").alias("r_type"),
        F.min("created_at").alias("r_created"),
        F.max("status").alias("status"),  # "processed" > "pending" > "dead"
        F.min("received_at").alias("received_at"),
        F.min("processed_at").alias("processed_at"),  # the first handling's
        F.max("attempts").alias("attempts"),
        F.max("dead_reason").alias("dead_reason"),
        F.max("last_error").alias("last_error"),
        F.sum("duplicates").alias("duplicates"),
        F.lit(True).alias("got"),
    )


def _reconcile(expected: DataFrame, received: DataFrame, window: Window | None) -> DataFrame:
    """Expected and received deliveries side by side (with the sent rows expected nowhere),
    restricted to `window`'s messages."""
    from pyspark.sql import functions as F

    # Both sides spread by message id; the receipts come sorted from their aggregation. The
    # rows keep only the columns the figures read: they are kept in memory.
    joined = expected.join(received, ["h", "message_id", "consumer"], "full_outer")
    rows = joined.select(
        "*",
        F.coalesce("routing_key", "r_type").alias("type"),
        F.coalesce("expected", F.lit(False)).alias("is_expected"),
        F.coalesce("got", F.lit(False)).alias("is_received"),
        F.coalesce("sent_row", F.lit(False)).alias("is_sent"),
    )
    if window is not None:  # a receipt of nobody's message: by its message's creation
        at = F.coalesce("published_at", "created_at", "r_created", "received_at")
        rows = rows.where((at >= F.lit(window.since)) & (at < F.lit(window.until)))
    return rows.drop(
        "h", "pos", "routing_key", "r_type", "r_created", "expected", "got", "sent_row"
    )


def _states(horizon: datetime) -> dict[str, Column]:
    """Conditions on a reconciled row."""
    from pyspark.sql import functions as F

    expected, received = F.col("is_expected"), F.col("is_received")
    missing = expected & ~received
    lost = missing & (F.col("published_at") < F.lit(horizon))
    return {
        "expected": expected,
        "received": received,
        "lost": lost,
        "in_flight": missing & ~lost,
        "sent": F.col("is_sent"),
        "dead": F.col("status") == "dead",
        "done": expected & (F.col("status") == "processed"),
    }


# Every figure comes from one query. The counts: every row once ("a"), grouped by what the
# figures tell apart (its consumer, the producer of a sent row, its type, status and states, its
# latency bucket...), which makes a few thousand groups at most, summed up on the driver; and the
# dead rows again ("c") by type, reason and error. The percentiles ("b"): the processed expected
# deliveries by type. The examples ("l", "w") and the throughput per FINE seconds ("t").
_SET = "g"


def _aggregate(rows: DataFrame, horizon: datetime, keep: bool = False) -> list[dict[str, Any]]:
    """Every figure of the summary from one query over `rows`; with `keep`, the latencies
    counted per `_latency_bucket` too ("d")."""
    from pyspark.sql import functions as F

    s = _states(horizon)
    g = F.col(_SET)
    in_a, sent = g == "a", s["sent"]
    error = F.substring(
        F.element_at(F.split(F.trim(F.coalesce("last_error", F.lit(""))), "\n"), -1), 1, 200
    )
    published = sent & F.col("published_at").isNotNull()
    dimensions = {
        "consumer": F.when(in_a, F.col("consumer")),
        "producer": F.when(in_a & sent, F.col("producer")),
        "type": F.col("type"),
        "status": F.when(in_a, F.col("status")),
        "kind": F.when(in_a & sent, F.col("kind")),
        "expected": in_a & s["expected"],
        "received": in_a & s["received"],
        "sent": in_a & sent,
        "lost": in_a & s["lost"],
        "published": in_a & published,
        "expired": in_a & sent & F.col("expired_at").isNotNull(),
        "twice": in_a & (F.col("copies") > 1),
        "retried": in_a & s["received"] & (F.col("attempts") > 1),
        "bucket": F.when(in_a & s["done"], _e2e_bucket(_stage_seconds()["end_to_end"])),
        "reason": F.when(~in_a, F.coalesce("dead_reason", F.lit("unknown"))),
        "error": F.when(~in_a, error),
    }
    sets = F.when(s["dead"], F.array(F.lit("a"), F.lit("c"))).otherwise(F.array(F.lit("a")))
    counts = (
        rows.select("*", F.explode(sets).alias(_SET))
        .groupBy(g, *(column.alias(name) for name, column in dimensions.items()))
        .agg(
            F.count("*").alias("n"),
            F.sum(F.when(in_a & published, F.col("publish_attempts"))).alias("publish_retries"),
            F.sum(F.when(in_a, F.col("duplicates"))).alias("duplicates_absorbed"),
            F.sum(F.when(in_a, F.greatest(F.col("attempts") - 1, F.lit(0)))).alias("retries"),
            F.max(F.when(in_a, F.col("attempts"))).alias("max_attempts"),
            F.min(F.when(in_a & sent, F.col("created_at"))).alias("first_created_at"),
            F.min(F.when(in_a & published, F.col("published_at"))).alias("first_published_at"),
            F.max(F.when(in_a & published, F.col("published_at"))).alias("last_published_at"),
            F.max(F.when(in_a, F.col("processed_at"))).alias("last_processed_at"),
        )
    )
    latencies = []
    for stage, column in _stage_seconds().items():
        latencies.append(F.percentile_approx(column, [0.5, 0.9, 0.99], 10000).alias(f"{stage}_p"))
        latencies.append(F.max(column).alias(f"{stage}_max"))
    lost = (
        rows.where(s["lost"])
        .select(
            F.lit("l").alias(_SET), "message_id", "type", "producer", "consumer", "published_at"
        )
        .orderBy("published_at", "message_id")
        .limit(EXAMPLES)
    )
    twice = (
        rows.where(F.col("copies") > 1)
        .select(F.lit("w").alias(_SET), "message_id", "type", "consumer", "copies")
        .orderBy(F.desc("copies"), "message_id")
        .limit(EXAMPLES)
    )
    done = rows.where(s["done"])
    query = reduce(
        lambda a, b: a.unionByName(b, allowMissingColumns=True),
        (counts, done.groupBy(F.lit("b").alias(_SET), "type").agg(*latencies), lost, twice),
    ).unionByName(_buckets(rows, FINE), allowMissingColumns=True)
    if keep:
        stages = [
            F.struct(F.lit(n).alias("stage"), c.alias("s")) for n, c in _stage_seconds().items()
        ]
        buckets = (
            done.select("type", F.inline(F.array(*stages)))
            .where(F.col("s").isNotNull())
            .groupBy(
                F.lit("d").alias(_SET), "type", "stage", _latency_bucket(F.col("s")).alias("lb")
            )
            .agg(F.count("*").alias("n"))
        )
        query = query.unionByName(buckets, allowMissingColumns=True)
    return [r.asDict() for r in query.collect()]


def _latency_bucket(seconds: Column) -> Column:
    """0 for no time; else ±(1 + the number of times RATIO fits into the microseconds)."""
    from pyspark.sql import functions as F

    grown = F.ceil(F.log(RATIO, F.abs(seconds) * 1e6) - 1e-9)
    return F.when(seconds == 0, 0).otherwise(F.signum(seconds).cast("long") * (grown + 1))


def _stage_seconds() -> dict[str, Column]:
    return {
        "publish": _seconds("published_at", "created_at"),
        "transit": _seconds("received_at", "published_at"),
        "processing": _seconds("processed_at", "received_at"),
        "end_to_end": _seconds("processed_at", "created_at"),
    }


def _e2e_bucket(seconds: Column) -> Column:
    """The latency histogram's bucket of an end-to-end time (null when unknown)."""
    from pyspark.sql import functions as F

    return F.when(
        seconds <= 10.0 ** (HISTOGRAM_LOW / HISTOGRAM_PER_DECADE), HISTOGRAM_LOW
    ).otherwise(F.least(F.ceil(F.log10(seconds) * HISTOGRAM_PER_DECADE), F.lit(HISTOGRAM_HIGH + 1)))


class _Figures:
    """The summary's figures, summed up from the groups of `_aggregate`."""

    def __init__(self, groups: Sequence[Any]) -> None:
        self.a = [r for r in groups if r[_SET] == "a"]
        self.b: dict[str, list[Any]] = {}  # by type: one row per window
        for r in sorted((r for r in groups if r[_SET] == "b"), key=lambda r: r["type"]):
            self.b.setdefault(r["type"], []).append(r)
        self.d: dict[tuple[str, str], Counter[int]] = {}  # latencies by type and stage
        for r in (r for r in groups if r[_SET] == "d"):
            self.d.setdefault((r["type"], r["stage"]), Counter())[int(r["lb"])] += int(r["n"])
        self.c = [r for r in groups if r[_SET] == "c"]
        self.totals = {
            name: sum(int(r[name] or 0) for r in self.a) if state is None else self._count(state)
            for name, state in _TOTALS.items()
        }
        self.first_created_at = _least(r["first_created_at"] for r in self.a)
        self.first_published_at = _least(r["first_published_at"] for r in self.a)
        self.last_processed_at = _greatest(r["last_processed_at"] for r in self.a)
        self.last_published_at = _greatest(r["last_published_at"] for r in self.a)

    def _count(self, state: Callable[[Row], Any], rows: Iterable[Row] | None = None) -> int:
        """The number of rows in the groups of `rows` (default: every "a" group) in `state`."""
        return sum(int(r["n"]) for r in (self.a if rows is None else rows) if state(r))

    def _by(self, dimension: str, state: Callable[[Row], Any]) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {}
        for r in self.a:
            if r[dimension] is not None and state(r):
                out.setdefault(r[dimension], []).append(r)
        return out

    def last_at(self) -> datetime | None:
        """The throughput's end: the last publication or processing, whichever is later."""
        return _greatest([self.last_published_at, self.last_processed_at])

    def services(self) -> list[dict[str, Any]]:
        sent = self._by("producer", lambda r: r["sent"])
        got = self._by("consumer", lambda r: True)
        out = []
        for service in sorted(set(sent) | set(got)):
            mine = got.get(service, [])
            out.append(
                {
                    "service": service,
                    "sent": self._count(lambda r: True, sent.get(service, [])),
                    "received": self._count(lambda r: r["received"], mine),
                    "processed": self._count(lambda r: r["status"] == "processed", mine),
                    "dead": self._count(lambda r: r["status"] == "dead", mine),
                    "lost": self._count(lambda r: r["lost"], mine),
                    "duplicates_absorbed": sum(int(r["duplicates_absorbed"] or 0) for r in mine),
                }
            )
        return out

    def latency(self) -> list[dict[str, Any]]:
        done = self._by("type", lambda r: r["expected"] and r["status"] == "processed")
        out = []
        for t, rows in self.b.items():  # of several windows: percentiles of the buckets ("d")
            stages = {}
            for stage in STAGES:
                counts = self.d.get((t, stage))
                p = [_float(v) for v in rows[0][f"{stage}_p"] or [None] * 3]
                if len(rows) > 1 and counts:
                    p = [_float(_from_buckets(counts, q)) for q in (0.5, 0.9, 0.99)]
                highest = (_float(r[f"{stage}_max"]) for r in rows)
                p.append(max((v for v in highest if v is not None), default=None))
                stages[stage] = dict(zip(PERCENTILES, p, strict=True))
            count = self._count(lambda _: True, done.get(t, []))
            out.append({"type": t, "count": count, "stages": stages})
        return out

    def histogram(self) -> list[dict[str, Any]]:
        counts: Counter[int] = Counter()
        for r in (r for r in self.a if r["bucket"] is not None):
            counts[int(r["bucket"])] += int(r["n"])
        if not counts:
            return []

        def le(b: int) -> float | None:  # the bucket's upper bound; None: the last, unbounded
            return None if b > HISTOGRAM_HIGH else round(10 ** (b / HISTOGRAM_PER_DECADE), 6)

        buckets = range(min(counts), max(counts) + 1)
        return [{"le_seconds": le(b), "count": counts.get(b, 0)} for b in buckets]

    def retries(self) -> list[dict[str, Any]]:
        out = [
            {
                "type": t,
                "messages": self._count(lambda _: True, rows),
                "retried_messages": self._count(lambda r: r["retried"], rows),
                "retries": sum(int(r["retries"] or 0) for r in rows),
                "max_attempts": max(int(r["max_attempts"] or 0) for r in rows),
            }
            for t, rows in self._by("type", lambda r: r["received"]).items()
        ]
        return sorted(out, key=lambda r: (-r["retries"], r["type"]))

    def dead_letters(self) -> dict[str, list[dict[str, Any]]]:
        by_type: dict[tuple[str, str], list[Row]] = {}
        causes: Counter[tuple[str, str]] = Counter()
        for r in self.c:
            by_type.setdefault((r["type"], r["reason"]), []).append(r)
            causes[(r["reason"], r["error"])] += r["n"]
        letters = [
            {
                "type": t,
                "reason": reason,
                "count": self._count(lambda _: True, rows),
                "example_error": min(r["error"] for r in rows) or "",
            }
            for (t, reason), rows in by_type.items()
        ]
        top = sorted(causes.items(), key=lambda item: (-item[1], item[0][0], item[0][1]))[:10]
        return {
            "dead_letters": sorted(letters, key=lambda d: (-d["count"], d["type"], d["reason"])),
            "dead_letter_causes": [
                {"reason": reason, "error": error or "", "count": n} for (reason, error), n in top
            ],
        }


_OUTBOX_USED = (
    "service", "message_id", "kind", "routing_key", "created_at", "published_at", "expired_at",
    "attempts",
)  # fmt: skip
_INBOX_USED = (
    "service", "message_id", "id", "routing_key", "status", "created_at", "received_at",
    "processed_at", "attempts", "dead_reason", "last_error", "duplicates", "archived_at",
)  # fmt: skip
# Every count of the summary's ``totals``: the rows of the "a" groups in a state, or (None)
# the sum of the column of that name.
_TOTALS: dict[str, Callable[[Row], Any] | None] = {
    "sent": lambda r: r["sent"],
    "commands": lambda r: r["kind"] == "command",
    "events": lambda r: r["kind"] == "event",
    "published": lambda r: r["published"],
    "expired": lambda r: r["expired"],
    "unpublished": lambda r: r["sent"] and not r["published"] and not r["expired"],
    "publish_retries": None,
    "expected_deliveries": lambda r: r["expected"],
    "delivered": lambda r: r["expected"] and r["received"],
    "lost": lambda r: r["lost"],
    "in_flight": lambda r: r["expected"] and not r["received"] and not r["lost"],
    "duplicates_absorbed": None,
    "handled_more_than_once": lambda r: r["twice"],
    "unexpected": lambda r: r["received"] and not r["expected"],
    "processed": lambda r: r["status"] == "processed",
    "pending": lambda r: r["status"] == "pending",
    "dead": lambda r: r["status"] == "dead",
    "retried_messages": lambda r: r["retried"],
    "retries": None,
}
#: Every count of the summary's ``totals``.
TOTALS = tuple(_TOTALS)


def _seconds(later: str, earlier: str) -> Column:
    from pyspark.sql import functions as F

    return (F.unix_micros(F.col(later)) - F.unix_micros(F.col(earlier))) / 1e6


def _step(start: datetime | None, end: datetime | None) -> int | None:
    """The throughput's bucket: the smallest that gives at most MAX_BUCKETS over the span."""
    if not (start and end):
        return None
    span = max((end - start).total_seconds(), 1.0)
    return next((s for s in BUCKET_STEPS if span / s <= MAX_BUCKETS), BUCKET_STEPS[-1])


class _Details:
    """The examples and the throughput, from the rows of `_aggregate` (of one or more windows),
    the throughput in buckets of `step` seconds."""

    def __init__(self, rows: Sequence[Any], step: int | None) -> None:
        self.rows, self.step = rows, step

    def lost(self) -> list[dict[str, Any]]:
        found = sorted(
            (r for r in self.rows if r[_SET] == "l"),
            key=lambda r: (_aware(r["published_at"]), r["message_id"]),
        )[:EXAMPLES]
        fields = ("message_id", "type", "producer", "consumer")
        return [
            {**{f: r[f] for f in fields}, "published_at": _iso(r["published_at"])} for r in found
        ]

    def handled_more_than_once(self) -> list[dict[str, Any]]:
        found = sorted(
            (r for r in self.rows if r[_SET] == "w"), key=lambda r: (-r["copies"], r["message_id"])
        )[:EXAMPLES]
        fields = ("message_id", "type", "consumer")
        return [{**{f: r[f] for f in fields}, "copies": int(r["copies"])} for r in found]

    def throughput(self) -> dict[str, Any]:
        """Published and processed per time bucket, from the first publication on."""
        counted = [r for r in self.rows if r[_SET] == "t"]
        if self.step is None or not counted:
            return {"bucket_seconds": self.step, "series": []}
        sent: Counter[int] = Counter()
        done: Counter[int] = Counter()
        for r in counted:  # buckets of `step` or of a step that divides it
            # "n" published; "sent" in the day results of the versions before 2026-12
            sent[int(r["b"]) // self.step * self.step] += int(r["n"] if "n" in r else r["sent"])
            done[int(r["b"]) // self.step * self.step] += int(r["done"])
        return {
            "bucket_seconds": self.step,
            "series": [
                {
                    "start": _iso(datetime.fromtimestamp(b, UTC)),
                    "published": sent.get(b, 0),
                    "processed": done.get(b, 0),
                }
                for b in range(min(sent), max(sent) + 1, self.step)
            ],
        }


def _buckets(rows: DataFrame, step: int) -> DataFrame:
    """Published and processed rows counted per bucket of `step` seconds."""
    from pyspark.sql import functions as F

    def bucket(column: str) -> Column:
        return (F.floor(F.unix_seconds(F.col(column)) / step) * step).cast("long")

    published = F.col("is_sent") & F.col("published_at").isNotNull()
    processed = (F.col("status") == "processed") & F.col("processed_at").isNotNull()
    marks = F.array(
        F.struct(F.when(published, bucket("published_at")).alias("b"), F.lit(0).alias("k")),
        F.struct(F.when(processed, bucket("processed_at")).alias("b"), F.lit(1).alias("k")),
    )
    return (
        rows.select(F.inline(marks))
        .where(F.col("b").isNotNull())
        .groupBy(F.lit("t").alias(_SET), "b")
        .agg(F.sum(1 - F.col("k")).alias("n"), F.sum("k").alias("done"))
    )


def _least(values: Iterable[Any]) -> datetime | None:
    return min((v for v in map(_aware, values) if v is not None), default=None)


def _greatest(values: Iterable[Any]) -> datetime | None:
    return max((v for v in map(_aware, values) if v is not None), default=None)


def _aware(value: Any) -> datetime | None:
    """Spark returns naive datetimes in the session time zone (UTC); day results ISO text."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
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
    "AuditError", "LiveRows", "Window", "check_archives", "combine", "read_archives", "read_live",
    "run_audit", "spark_session",
]  # fmt: skip
