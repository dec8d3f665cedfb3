"""Benchmark of the PySpark audit: as a user runs it, warm next to Spark's own limits,
incremental by day, and on a standalone cluster of one and two workers.

    .venv/bin/python bench/audit.py [--only cold,warm,incremental,cluster] [--json FILE]
        [--cold-sizes 100000 1000000] [--sizes 1000000 10000000] [--repeat 3]
        [--month-messages 3000000] [--cluster-size 10000000]
        [--worker-memory 2g] [--cluster-conf KEY=VALUE ...] [--dir DIR] [--master local[*]]
        [--driver-memory 6g] [--warm-up 20000]

Every figure is taken on synthetic histories (`outbox_inbox.analytics.synthetic`: three
services over 3 days, about 2.2 archived rows per message, a few hundred faults of each kind),
generated once under --dir and shared by the groups that need the same size. Rows are archived
rows (outbox + inbox). The groups run in this order (the cluster's session before the local
one: the settings that start the driver's JVM stay its defaults for every later session):

cold         first a cold PySpark process (`python -c`) that only reads the same files and
             full-joins inbox to outbox on message_id, twice (the second is the baseline);
             then `outbox-inbox audit ROOTS --out DIR --json` (the venv's console script) as
             a subprocess, as a user runs it, twice per size on a fresh warm server (its own
             state directory under --dir): the first run starts the local Spark Connect
             server, the second reuses it; the server is stopped after. Targets: first run
             <= 1.5 x the cold join, repeated run <= 1.0 x it, at 1,000,000 messages.
             Its totals must equal the generator's, lost and in flight counted together (the
             CLI audits at the real now, the generator's history ends in its own past).
cluster      a standalone master and workers on loopback, started from PySpark's own
             launcher (as tests/e2e/test_audit_on_a_cluster.py), each worker 1 core and
             --worker-memory (the executor's memory too): the audit of --cluster-size messages
             from a driver in this process (`spark_session("spark://...")`), once with one
             worker, then once with a second worker started (the worker count changes;
             spark.cores.max is not set). Each run is one application: its executors are
             waited for, warmed up with an untimed audit of --warm-up messages, then the audit
             is timed once. The session has Spark's defaults for a cluster (those of
             `outbox-inbox audit --master spark://...`) plus any --cluster-conf. Spark's own
             metrics of the timed audit, read from the driver's REST API: per stage tasks,
             duration, executor run and CPU time, shuffle read and write (stages of one job
             overlap in time); per run jobs, stages and shuffles (stages that write a
             shuffle), and the executors' CPU seconds over wall x cores (1.0: every executor
             core computing all the time). And from /proc, the CPU seconds of the driver
             (Python + JVM), the master, the workers with their executors, and the whole
             machine (other users included) against wall x CPUs.
warm         on one local SparkSession (--master, --driver-memory), after an untimed round of
             --warm-up messages (default 20,000), the best of --repeat runs of each of:
               scan  -- read every archived row, decoding the message id, a time and the
                        routing key: Spark's read limit on these files;
               join  -- inbox full-outer-joined to outbox on message_id and counted: the
                        least any reconciliation must do (one shuffle of both sides);
               audit -- `run_audit` over the same roots: the whole summary.
             audit/join = join s / audit s (target >= 0.5); the CPU seconds of the driver's
             Python process and of its JVM (/proc/<pid>/stat, which getrusage does not see)
             during the fastest run, and the audit's CPU microseconds per archived row. The
             audit's totals must equal the generator's.
incremental  a 30-day history of --month-messages: the full audit, and the audit of its last
             full day (`Window(day, day + 1 day)`, reading its days and the later ones), best of
             --repeat on the warm session; day / full (target <= 0.10). The day's totals must
             not all be zero.

This is a benchmark, not a test: it fails only when a group cannot finish, or when the counts
are wrong. --json writes every figure and the machine (CPUs, memory, Python, Java, PySpark,
master, driver memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # As bench/run.py: run as a script, Python puts bench/ first on the path; the package needs
    # the repository root instead.
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.cli import group_list, guarded
from bench.timing import BenchError, machine_busy_seconds, tree_cpu_seconds
from outbox_inbox.analytics.audit import Window, combine, read_archives, run_audit, spark_session
from outbox_inbox.analytics.synthetic import Expected, Faults, generate
from outbox_inbox.archive import INBOX, OUTBOX
from outbox_inbox.testing.servers import free_port

#: Groups of figures that --only chooses from, in the order they run.
GROUPS = ("cold", "cluster", "warm", "incremental")
FAULTS = Faults(
    lost=50,
    in_flight=5,
    handled_twice=5,
    expired=20,
    unexpected=20,
    duplicates=500,
    retried=1000,
    dead=300,
)
WARM_UP = 20_000  # default size of the untimed round that lets the JVM compile the hot paths
MONTH = timedelta(days=30)
LOOPBACK = "127.0.0.1"
CLOCK_DEPENDENT = ("lost", "in_flight")  # the totals that move with the audit's now
TARGETS = {
    "cold_1m_second_run_s": 15.0,
    "audit_over_join": 0.5,
    "day_over_full": 0.10,
    "combined_over_full": 0.05,
}


class AuditBench:
    """One run: its options, the histories generated so far, the figures measured, and what
    `cleanup` stops and removes (the SparkSession, the cluster, a temporary --dir)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = Path(args.dir or tempfile.mkdtemp(prefix="outbox-inbox-bench-audit-"))
        self.base.mkdir(parents=True, exist_ok=True)
        self.histories: dict[tuple[int, int], tuple[Expected, int]] = {}
        self.figures: dict[str, Any] = {}
        self.spark: Any = None
        self.cluster: Cluster | None = None
        self.warmed_up = False

    def history(self, messages: int, days: int = 3) -> tuple[Expected, int]:
        """The synthetic history of `messages` over `days` (generated on first use) and its
        number of archived rows."""
        key = (messages, days)
        if key not in self.histories:
            directory = self.base / f"history-{messages}-{days}d"
            shutil.rmtree(directory, ignore_errors=True)
            start = time.perf_counter()
            expected = generate(directory, messages, FAULTS, span=timedelta(days=days))
            seconds = time.perf_counter() - start
            rows = _archived_rows(expected.roots)
            print(
                f"  (generated {messages:,} messages over {days} days, {rows:,} rows, "
                f"in {seconds:.1f} s)",
                flush=True,
            )
            self.histories[key] = (expected, rows)
        return self.histories[key]

    def local_spark(self) -> Any:
        """The local SparkSession of the warm groups, warmed up once (untimed)."""
        if self.spark is None:
            self.session(self.args.master, driver_memory=self.args.driver_memory)
        if not self.warmed_up:
            expected, _ = self.history(self.args.warm_up)
            _scan(self.spark, expected.roots)
            _join(self.spark, expected.roots)
            run_audit(self.spark, expected.roots, now=expected.now, grace=expected.grace)
            self.warmed_up = True
        return self.spark

    def session(self, master: str, **options: Any) -> Any:
        """`spark_session(master, **options)`, which `cleanup` stops."""
        self.spark = spark_session(master, **options)
        # PySpark's SIGINT handler asks the JVM to cancel the jobs from inside the call that
        # waits for the JVM (py4j: "reentrant call"), which turns Ctrl-C into a Py4JError in
        # the middle of the run; Python's own raises KeyboardInterrupt, which guarded() takes.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return self.spark

    def stop_spark(self) -> None:
        if self.spark is not None:
            spark, self.spark = self.spark, None
            spark.stop()
        self.warmed_up = False

    def cleanup(self) -> None:
        try:
            self.stop_spark()
        finally:
            if self.cluster is not None:
                self.cluster.stop()
            if not self.args.dir:
                shutil.rmtree(self.base, ignore_errors=True)


def _archived_rows(roots: Sequence[str]) -> int:
    """Outbox and inbox rows of `roots`, from the Parquet footers."""
    import pyarrow.dataset as ds

    return sum(
        ds.dataset(f"{root}/{source}", format="parquet").count_rows()
        for root in roots
        for source in (OUTBOX, INBOX)
        if Path(root, source).is_dir()
    )


def _scan(spark: Any, roots: Sequence[str]) -> int:
    """Read every archived row, decoding the columns the audit reads (a bare count() would be
    answered from the Parquet footers); return the rows."""
    from pyspark.sql import functions as F

    total = 0
    for source, time_column in ((OUTBOX, "published_at"), (INBOX, "processed_at")):
        row = (
            read_archives(spark, roots, source)
            .agg(F.count("message_id"), F.max(time_column), F.max("routing_key"))
            .first()
        )
        total += int(row[0])
    return total


def _join(spark: Any, roots: Sequence[str]) -> int:
    from pyspark.sql import functions as F

    outbox = read_archives(spark, roots, OUTBOX).select("message_id", "published_at")
    inbox = read_archives(spark, roots, INBOX).select("message_id", "received_at")
    return int(outbox.join(inbox, "message_id", "full_outer").agg(F.count("*")).first()[0])


def _jvm_pid(spark: Any) -> int:
    return int(spark.sparkContext._jvm.ProcessHandle.current().pid())


def _python_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(spark: Any, run: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """Run `run`; its wall seconds and the CPU seconds of the driver's Python and JVM."""
    jvm = frozenset({_jvm_pid(spark)})
    python0, jvm0, start = _python_cpu(), tree_cpu_seconds(jvm) or 0.0, time.perf_counter()
    value = run()
    wall = time.perf_counter() - start
    python_s, jvm_s = _python_cpu() - python0, (tree_cpu_seconds(jvm) or 0.0) - jvm0
    return {"s": wall, "python_cpu_s": python_s, "jvm_cpu_s": jvm_s}, value


def _best(spark: Any, what: str, run: Callable[[], Any], repeat: int) -> tuple[dict[str, Any], Any]:
    """The fastest of `repeat` runs of `run` (its CPU seconds too), every run's time, and the
    last run's value."""
    runs, value = [], None
    for _ in range(repeat):
        timing, value = _timed(spark, run)
        runs.append(timing)
        print(f"    {what:<6} {timing['s']:8.2f} s", flush=True)
    best = min(runs, key=lambda r: r["s"])
    return {**{k: round(v, 3) for k, v in best.items()}, "runs_s": _rounded(runs)}, value


def _rounded(runs: list[dict[str, float]]) -> list[float]:
    return [round(r["s"], 3) for r in runs]


# --- cold -----------------------------------------------------------------------------------


_COLD_JOIN = """
import sys
from pyspark.sql import functions as F
from outbox_inbox.analytics.audit import read_archives, spark_session
spark = spark_session("local[*]")
outbox = read_archives(spark, sys.argv[1:], "outbox").select("message_id", "published_at")
inbox = read_archives(spark, sys.argv[1:], "inbox").select("message_id", "received_at")
print(outbox.join(inbox, "message_id", "full_outer").agg(F.count("*")).first()[0])
"""


def cold(bench: AuditBench) -> None:
    """A cold PySpark process that only reads the files and full-joins inbox to outbox (twice,
    the second judged), then the CLI as a subprocess twice per size on its warm server (the
    first run starts it, the second reuses it), stopped after."""
    script = Path(sys.executable).parent / "outbox-inbox"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "outbox_inbox.cli.main"]
    print(f"\ncold: {' '.join([Path(command[0]).name, *command[1:]])} audit ROOTS --out DIR --json")
    env = {**os.environ, "OUTBOX_INBOX_SPARK_SERVER": "warm"}
    env["OUTBOX_INBOX_SPARK_DIR"] = str(bench.base / "spark-server")
    results = bench.figures.setdefault("cold", [])
    for size in bench.args.cold_sizes:
        expected, rows = bench.history(size)
        joins = []
        for _ in (1, 2):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", _COLD_JOIN, *expected.roots], check=True)
            joins.append(round(time.perf_counter() - start, 2))
        print(f"    cold PySpark join: {joins[0]:6.1f} s, {joins[1]:6.1f} s", flush=True)
        subprocess.run([*command, "audit", "--server", "stop"], env=env, check=True)
        runs = []
        for attempt in (1, 2):
            out = bench.base / f"cold-report-{size}-{attempt}"
            start = time.perf_counter()
            done = subprocess.run(
                [*command, "audit", *expected.roots, "--out", str(out), "--json"],
                capture_output=True,
                text=True,
                timeout=3600,
                check=False,
                env=env,
            )
            seconds = time.perf_counter() - start
            if done.returncode not in (0, 4):  # 4: something lost, as the generator made it
                raise BenchError(f"the CLI exited {done.returncode}: {done.stderr[-3000:]}")
            totals = json.loads((out / "summary.json").read_text())["totals"]
            exact = _clock_free(totals) == _clock_free(expected.totals)
            print(f"    run {attempt}: {seconds:6.1f} s; totals exact: {exact}", flush=True)
            print(f"      {done.stderr.strip().splitlines()[0]}", flush=True)
            if not exact:
                raise BenchError(f"the CLI's totals {totals} are not {expected.totals}")
            runs.append(round(seconds, 2))
        subprocess.run([*command, "audit", "--server", "stop"], env=env, check=True)
        results.append(
            {
                "messages": size,
                "rows": rows,
                "runs_s": runs,
                "cold_join_s": joins,
                "first_over_cold_join": round(runs[0] / joins[1], 3),
                "repeated_over_cold_join": round(runs[1] / joins[1], 3),
                "totals_exact": True,
            }
        )


def _clock_free(totals: dict[str, int]) -> dict[str, int]:
    kept = {k: v for k, v in totals.items() if k not in CLOCK_DEPENDENT}
    return {**kept, "lost+in_flight": sum(totals.get(k, 0) for k in CLOCK_DEPENDENT)}


# --- warm -----------------------------------------------------------------------------------


def warm(bench: AuditBench) -> None:
    """scan, join and audit on one warm local SparkSession, best of --repeat each."""
    args = bench.args
    print(f"\nwarm: best of {args.repeat} on one SparkSession ({args.master})", flush=True)
    spark = bench.local_spark()
    results = bench.figures.setdefault("warm", [])
    for size in args.sizes:
        expected, rows = bench.history(size)
        print(f"  {size:,} messages, {rows:,} rows", flush=True)
        roots = expected.roots
        scan, scanned = _best(spark, "scan", functools.partial(_scan, spark, roots), args.repeat)
        join, _ = _best(spark, "join", functools.partial(_join, spark, roots), args.repeat)
        audit, summary = _best(
            spark,
            "audit",
            functools.partial(run_audit, spark, roots, now=expected.now, grace=expected.grace),
            args.repeat,
        )
        if scanned != rows or summary["totals"] != expected.totals:
            raise BenchError(
                f"{size:,} messages: scanned {scanned:,} of {rows:,} rows; audit totals "
                f"{summary['totals']} expected {expected.totals}"
            )
        cpu_s = audit["python_cpu_s"] + audit["jvm_cpu_s"]
        results.append(
            {
                "messages": size,
                "rows": rows,
                "scan": scan,
                "join": join,
                "audit": audit,
                "scan_rows_per_s": round(rows / scan["s"]),
                "join_rows_per_s": round(rows / join["s"]),
                "audit_rows_per_s": round(rows / audit["s"]),
                "audit_over_join": round(join["s"] / audit["s"], 3),
                "audit_cpu_us_per_row": round(cpu_s / rows * 1e6, 2),
                "counts_exact": True,
            }
        )


# --- incremental ----------------------------------------------------------------------------


def incremental(bench: AuditBench) -> None:
    """The full audit of a month against the audit of its last full day."""
    args = bench.args
    print(f"\nincremental: best of {args.repeat} on one SparkSession ({args.master})", flush=True)
    spark = bench.local_spark()
    expected, rows = bench.history(args.month_messages, MONTH.days)
    assert expected.now is not None
    now = expected.now
    day = datetime(now.year, now.month, now.day, tzinfo=UTC) - timedelta(days=1)
    window = Window(day, day + timedelta(days=1))
    full, summary = _best(
        spark,
        "full",
        lambda: run_audit(spark, expected.roots, now=now, grace=expected.grace),
        args.repeat,
    )
    if summary["totals"] != expected.totals:
        raise BenchError(f"the month's totals {summary['totals']} expected {expected.totals}")
    one_day, summary = _best(
        spark,
        "day",
        lambda: run_audit(spark, expected.roots, now=now, grace=expected.grace, window=window),
        args.repeat,
    )
    if not any(summary["totals"].values()):
        raise BenchError(f"the audit of {day.date()} found nothing: {summary['totals']}")
    # Every day's result, kept as `--results` keeps it, then the month combined from them.
    parts, started = [], time.perf_counter()
    for n in range(MONTH.days):
        since = day - timedelta(days=MONTH.days - 1 - n)
        kept = run_audit(
            spark,
            expected.roots,
            now=now,
            grace=expected.grace,
            window=Window(since, since + timedelta(days=1)),
            keep=True,
        )
        parts += json.loads(json.dumps(kept["parts"], default=str))
    days_s = time.perf_counter() - started
    combined, month = _best(
        spark, "month", lambda: combine(parts, now.isoformat(), {}), args.repeat
    )
    if month["totals"] != expected.totals:
        raise BenchError(
            f"the combined month's totals {month['totals']} expected {expected.totals}"
        )
    bench.figures["incremental"] = {
        "messages": args.month_messages,
        "days": MONTH.days,
        "rows": rows,
        "day": day.date().isoformat(),
        "days_read": sorted(  # the window's day and the later ones the archive holds
            d
            for d in {p.name[5:] for r in expected.roots for p in Path(r).glob("*/*/date=*")}
            if d >= window.days()[0]
        ),
        "full": full,
        "one_day": one_day,
        "day_over_full": round(one_day["s"] / full["s"], 3),
        "day_totals": summary["totals"],
        "day_results_s": round(days_s, 3),
        "combined": combined,
        "combined_over_full": round(combined["s"] / full["s"], 4),
    }


# --- cluster --------------------------------------------------------------------------------


class Cluster:
    """A standalone Spark master and workers on loopback, each in a process group of its own
    (a worker's executors in the worker's); `stop` kills the groups."""

    def __init__(self, directory: Path) -> None:
        import pyspark

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.home = Path(pyspark.__file__).parent
        self.url = f"spark://{LOOPBACK}:{free_port()}"
        self.env = {
            **os.environ,
            "SPARK_HOME": str(self.home),
            "SPARK_LOCAL_IP": LOOPBACK,
            "SPARK_LOG_DIR": str(directory),
            "PYSPARK_PYTHON": sys.executable,
        }
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []

    def start_master(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        self.master = self._start(
            "master",
            ["org.apache.spark.deploy.master.Master", "--host", LOOPBACK, "--port", port],
            "I have been elected leader",
        )

    def add_worker(self, memory: str) -> None:
        n = len(self.workers) + 1
        self.workers.append(
            self._start(
                f"worker-{n}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    self.url,
                    "--host",
                    LOOPBACK,
                    "--cores",
                    "1",
                    "--memory",
                    memory,
                    "--work-dir",
                    str(self.directory / f"work-{n}"),
                ],
                "Successfully registered",
            )
        )

    def _start(self, name: str, args: list[str], ready: str) -> subprocess.Popen[bytes]:
        log = self.directory / f"{name}.log"
        launcher = str(self.home / "bin" / "spark-class")
        with log.open("wb") as out:
            process = subprocess.Popen(
                [launcher, *args, "--webui-port", str(free_port())],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if ready in log.read_text(errors="replace"):
                return process
            time.sleep(0.3)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        raise BenchError(f"the {name} did not start: {log.read_text(errors='replace')[-3000:]}")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the master, and by the workers with their executors."""
        master = frozenset({self.master.pid}) if self.master else frozenset()
        workers = frozenset(p.pid for p in self.workers)
        return {
            "master": tree_cpu_seconds(master) or 0.0,
            "workers": tree_cpu_seconds(workers) or 0.0,
        }

    def stop(self) -> None:
        for process in [*reversed(self.workers), *([self.master] if self.master else [])]:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        self.workers, self.master = [], None


def cluster(bench: AuditBench) -> None:
    """The audit of --cluster-size messages on one standalone worker, then on two."""
    args = bench.args
    # One SparkContext per process: the local session, if any, makes way for the cluster's.
    bench.stop_spark()
    expected, rows = bench.history(args.cluster_size)
    bench.cluster = cluster_ = Cluster(bench.base / "cluster")
    try:
        cluster_.start_master()
        print(
            f"\ncluster: {args.cluster_size:,} messages, {rows:,} rows; standalone master "
            f"{cluster_.url}, workers of 1 core and {args.worker_memory}",
            flush=True,
        )
        runs = []
        for workers in (1, 2):
            cluster_.add_worker(args.worker_memory)
            runs.append(_cluster_run(bench, cluster_, expected, workers))
    finally:
        cluster_.stop()
    bench.figures["cluster"] = {
        "messages": args.cluster_size,
        "rows": rows,
        "how": "worker count: 1 worker, then a second one started; each 1 core; "
        "spark.cores.max not set",
        "worker_memory": args.worker_memory,
        "conf": dict(args.cluster_conf),
        "runs": runs,
        "speed_up": round(runs[0]["audit_s"] / runs[1]["audit_s"], 3),
    }


def _cluster_run(
    bench: AuditBench, cluster_: Cluster, expected: Expected, workers: int
) -> dict[str, Any]:
    """One application on the cluster as it stands: its executors, an untimed warm-up, the
    timed audit, its CPU seconds and Spark's metrics of it."""
    args = bench.args
    warm_up, _ = bench.history(args.warm_up)
    ui_port = free_port()
    spark = bench.session(
        cluster_.url,
        config={
            "spark.ui.enabled": "true",
            "spark.ui.port": str(ui_port),
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.driver.memory": args.driver_memory,  # when this session starts the JVM
            "spark.executor.memory": args.worker_memory,
            **dict(args.cluster_conf),
        },
    )
    try:
        _wait_for_executors(spark, workers)
        context = spark.sparkContext
        context.setJobGroup("warm-up", "untimed")
        run_audit(spark, warm_up.roots, now=warm_up.now, grace=warm_up.grace)
        context.setJobGroup("audit", f"{args.cluster_size:,} messages")
        driver = frozenset({_jvm_pid(spark)})
        before = (_python_cpu(), tree_cpu_seconds(driver) or 0.0, cluster_.cpu_seconds())
        busy0, start = machine_busy_seconds(), time.perf_counter()
        summary = run_audit(spark, expected.roots, now=expected.now, grace=expected.grace)
        seconds = time.perf_counter() - start
        busy1 = machine_busy_seconds()
        after = (_python_cpu(), tree_cpu_seconds(driver) or 0.0, cluster_.cpu_seconds())
        if summary["totals"] != expected.totals:
            raise BenchError(f"cluster totals {summary['totals']} expected {expected.totals}")
        metrics = _spark_metrics(f"http://{LOOPBACK}:{ui_port}", context.applicationId)
        shuffle_partitions = spark.conf.get("spark.sql.shuffle.partitions")
    finally:
        bench.stop_spark()
    cpu = {
        "driver_python": after[0] - before[0],
        "driver_jvm": after[1] - before[1],
        "master": after[2]["master"] - before[2]["master"],
        "workers_and_executors": after[2]["workers"] - before[2]["workers"],
    }
    if busy0 is not None and busy1 is not None:
        cpu["machine"] = busy1 - busy0
    print(f"  {workers} worker(s): audit {seconds:.1f} s", flush=True)
    return {
        "workers": workers,
        "cores": workers,
        "shuffle_partitions": int(shuffle_partitions),
        "audit_s": round(seconds, 2),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_s_available": round(seconds * (os.cpu_count() or 1), 2),
        # How busy the executors' cores were: 1.0 is every core computing all the time.
        "executor_cpu_over_wall_cores": round(metrics["executor_cpu_s"] / (seconds * workers), 3),
        "counts_exact": True,
        **metrics,
    }


def _wait_for_executors(spark: Any, executors: int, timeout: float = 120) -> None:
    """Until `executors` executors registered (the timed run must not start with fewer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The driver counts itself among the block managers.
        if spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() >= executors + 1:
            return
        time.sleep(0.5)
    raise BenchError(f"{executors} executor(s) did not register within {timeout:.0f} s")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _spark_metrics(ui: str, app: str, group: str = "audit") -> dict[str, Any]:
    """Spark's own figures of the jobs of `group`, from the driver's REST API."""
    base = f"{ui}/api/v1/applications/{app}"
    # The UI learns of finished jobs and stages from an asynchronous listener: wait for it.
    deadline = time.monotonic() + 60
    while True:
        jobs = [j for j in _get(f"{base}/jobs") if j.get("jobGroup") == group]
        ids = {s for j in jobs for s in j["stageIds"]}
        stages = [s for s in _get(f"{base}/stages") if s["stageId"] in ids]
        settled = all(j["status"] != "RUNNING" for j in jobs) and all(
            s["status"] not in ("ACTIVE", "PENDING") for s in stages
        )
        if (jobs and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    done = sorted(
        (s for s in stages if s["status"] == "COMPLETE"),
        key=lambda s: (s["stageId"], s["attemptId"]),
    )
    per_stage = [
        {
            "stage": s["stageId"],
            "attempt": s["attemptId"],
            "name": s["name"],
            "tasks": s["numTasks"],
            "duration_s": round(_seconds_between(s["submissionTime"], s["completionTime"]), 3),
            "executor_run_s": round(s["executorRunTime"] / 1e3, 3),
            "executor_cpu_s": round(s["executorCpuTime"] / 1e9, 3),
            "input_bytes": s["inputBytes"],
            "shuffle_read_bytes": s["shuffleReadBytes"],
            "shuffle_write_bytes": s["shuffleWriteBytes"],
        }
        for s in done
    ]
    return {
        "jobs": len(jobs),
        "stages": len(per_stage),
        "stages_skipped": sum(j.get("numSkippedStages", 0) for j in jobs),
        "shuffles": sum(1 for s in per_stage if s["shuffle_write_bytes"] > 0),
        "tasks": sum(s["tasks"] for s in per_stage),
        "executor_run_s": round(sum(s["executor_run_s"] for s in per_stage), 2),
        "executor_cpu_s": round(sum(s["executor_cpu_s"] for s in per_stage), 2),
        "per_stage": per_stage,
    }


def _seconds_between(start: str, end: str) -> float:
    """Seconds between two of the REST API's times (``2026-11-26T07:13:27.569GMT``)."""

    def parse(value: str) -> datetime:
        return datetime.strptime(value.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")

    return (parse(end) - parse(start)).total_seconds()


# --- the run --------------------------------------------------------------------------------


def run(bench: AuditBench) -> None:
    for name, group in (
        ("cold", cold),
        ("cluster", cluster),
        ("warm", warm),
        ("incremental", incremental),
    ):
        if name in bench.args.only:
            group(bench)


def print_tables(figures: dict[str, Any], args: argparse.Namespace) -> None:
    if "cold" in figures:
        print(
            f"\ncold: outbox-inbox audit as a subprocess, JVM start included "
            f"(target <= {TARGETS['cold_1m_second_run_s']:.0f} s at 1,000,000, second run)"
        )
        print(
            f"{'messages':>12} {'rows':>12} {'cold join s':>11} {'1st run s':>10} "
            f"{'2nd run s':>10} {'1st/join':>9} {'2nd/join':>9} {'exact':>6}"
        )
        for r in figures["cold"]:
            first, second = r["runs_s"]
            print(
                f"{r['messages']:>12,} {r['rows']:>12,} {r['cold_join_s'][1]:>11.1f} "
                f"{first:>10.1f} {second:>10.1f} {r['first_over_cold_join']:>9.2f} "
                f"{r['repeated_over_cold_join']:>9.2f} {r['totals_exact']!s:>6}"
            )
    if "warm" in figures:
        print(
            f"\nwarm: best of {args.repeat} on one SparkSession ({args.master}, driver "
            f"{args.driver_memory}); audit/join target >= {TARGETS['audit_over_join']}"
        )
        print(
            f"{'messages':>12} {'rows':>12} {'scan s':>7} {'join s':>7} {'audit s':>8} "
            f"{'scan rows/s':>12} {'join rows/s':>12} {'audit rows/s':>13} {'audit/join':>10} "
            f"{'audit CPU s (py+jvm)':>21} {'CPU us/row':>10}"
        )
        for r in figures["warm"]:
            audit = r["audit"]
            cpu = f"{audit['python_cpu_s']:.1f}+{audit['jvm_cpu_s']:.1f}"
            print(
                f"{r['messages']:>12,} {r['rows']:>12,} {r['scan']['s']:>7.2f} "
                f"{r['join']['s']:>7.2f} {audit['s']:>8.2f} {r['scan_rows_per_s']:>12,} "
                f"{r['join_rows_per_s']:>12,} {r['audit_rows_per_s']:>13,} "
                f"{r['audit_over_join']:>10.2f} {cpu:>21} {r['audit_cpu_us_per_row']:>10.2f}"
            )
    if "incremental" in figures:
        r = figures["incremental"]
        print(
            f"\nincremental: {r['messages']:,} messages over {r['days']} days ({r['rows']:,} "
            f"rows), best of {args.repeat}; target day/full <= {TARGETS['day_over_full']}"
        )
        print(f"  full audit        {r['full']['s']:8.2f} s")
        print(f"  day {r['day']}    {r['one_day']['s']:8.2f} s  (reads {len(r['days_read'])} days)")
        print(f"  day / full        {r['day_over_full']:8.3f}")
        print(f"  30 day results    {r['day_results_s']:8.2f} s  (each day's audit, kept)")
        print(f"  combined month    {r['combined']['s']:8.3f} s  (target / full <= 0.05)")
        print(f"  combined / full   {r['combined_over_full']:8.4f}")
        totals = r["day_totals"]
        print(
            "  the day's totals: "
            + ", ".join(f"{k} {totals[k]:,}" for k in ("sent", "expected_deliveries", "delivered"))
        )
    if "cluster" in figures:
        _print_cluster(figures["cluster"])


def _print_cluster(c: dict[str, Any]) -> None:
    conf = " ".join(f"{k}={v}" for k, v in c["conf"].items()) or "none"
    print(f"\ncluster: {c['messages']:,} messages ({c['rows']:,} rows); {c['how']}")
    partitions = c["runs"][0]["shuffle_partitions"]
    print(f"extra settings: {conf}; spark.sql.shuffle.partitions {partitions}")
    print(
        f"{'workers':>7} {'audit s':>8} {'jobs':>5} {'stages':>6} {'shuffles':>8} {'tasks':>6} "
        f"{'exec run s':>10} {'exec CPU s':>10} {'exec CPU/(wall x cores)':>23} "
        f"{'CPU s: driver py+jvm / master / workers':>40} {'machine CPU s / available':>26}"
    )
    for r in c["runs"]:
        cpu = r["cpu_s"]
        driver = f"{cpu['driver_python']:.1f}+{cpu['driver_jvm']:.1f}"
        ours = f"{driver} / {cpu['master']:.1f} / {cpu['workers_and_executors']:.1f}"
        machine = f"{cpu.get('machine', float('nan')):.1f} / {r['cpu_s_available']:.1f}"
        print(
            f"{r['workers']:>7} {r['audit_s']:>8.1f} {r['jobs']:>5} {r['stages']:>6} "
            f"{r['shuffles']:>8} {r['tasks']:>6} {r['executor_run_s']:>10.1f} "
            f"{r['executor_cpu_s']:>10.1f} {r['executor_cpu_over_wall_cores']:>23.2f} "
            f"{ours:>40} {machine:>26}"
        )
    print(f"speed-up with 2 workers: x{c['speed_up']:.2f}")
    for r in c["runs"]:
        print(f"\n  stages of the audit on {r['workers']} worker(s)")
        print(
            f"  {'stage':>5} {'tasks':>5} {'wall s':>7} {'run s':>7} {'CPU s':>7} "
            f"{'CPU/wall':>8} {'shuffle read MB':>15} {'write MB':>9}  name"
        )
        for s in r["per_stage"]:
            busy = s["executor_cpu_s"] / s["duration_s"] if s["duration_s"] else 0.0
            print(
                f"  {s['stage']:>5} {s['tasks']:>5} {s['duration_s']:>7.2f} "
                f"{s['executor_run_s']:>7.2f} {s['executor_cpu_s']:>7.2f} {busy:>8.2f} "
                f"{s['shuffle_read_bytes'] / 1e6:>15.1f} {s['shuffle_write_bytes'] / 1e6:>9.1f}"
                f"  {s['name'][:60]}"
            )


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """What the figures ran on."""
    import pyspark

    try:
        java = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        java = None
    try:
        with open("/proc/meminfo") as f:
            memory_kb = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        memory_kb = 0
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(memory_kb / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "java": java,
        "pyspark": pyspark.__version__,
        "master": args.master,
        "driver_memory": args.driver_memory,
        "worker_memory": args.worker_memory,
        "cli_driver_memory": "the CLI's default (2g)",
    }


def _setting(value: str) -> tuple[str, str]:
    key, sep, setting = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {value!r}")
    return key.strip(), setting


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(prog="bench/audit.py", description=doc.split("\n\n")[0])
    parser.add_argument(
        "--only",
        type=functools.partial(group_list, groups=GROUPS),
        default=list(GROUPS),
        metavar="GROUP[,GROUP]",
        help=f"run only these groups (default all: {','.join(GROUPS)}, in that order)",
    )
    parser.add_argument(
        "--cold-sizes",
        type=int,
        nargs="+",
        default=[100_000, 1_000_000],
        metavar="N",
        help="cold: messages of each history the CLI audits (default 100000 1000000)",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1_000_000, 10_000_000],
        metavar="N",
        help="warm: messages of each history (default 1000000 10000000)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="warm, incremental: runs of each figure after the warm-up; the best counts",
    )
    parser.add_argument(
        "--month-messages",
        type=int,
        default=3_000_000,
        metavar="N",
        help="incremental: messages of the 30-day history (default 3000000)",
    )
    parser.add_argument(
        "--cluster-size",
        type=int,
        default=10_000_000,
        metavar="N",
        help="cluster: messages of the history audited (default 10000000)",
    )
    parser.add_argument(
        "--worker-memory",
        default="2g",
        help="cluster: memory of each worker and its executor (default 2g)",
    )
    parser.add_argument(
        "--cluster-conf",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cluster: Spark setting of the cluster's sessions (repeatable; default none: what "
        "`outbox-inbox audit --master spark://...` gets)",
    )
    parser.add_argument(
        "--dir", help="generate the histories here and keep them (default: a temp dir, removed)"
    )
    parser.add_argument("--master", default="local[*]", help="warm, incremental: Spark master")
    parser.add_argument(
        "--driver-memory", default="6g", help="the driver's memory in this process (default 6g)"
    )
    parser.add_argument(
        "--warm-up",
        type=int,
        default=WARM_UP,
        metavar="N",
        help=f"warm, incremental, cluster: messages of the untimed warm-up round (default "
        f"{WARM_UP}; a size that --cold-sizes names shares its history)",
    )
    parser.add_argument("--json", help="also write every figure and the machine to this file")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.warm_up < 1:
        parser.error("--warm-up must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The driver, the cluster and the executors talk on loopback only.
    os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    bench = AuditBench(args)
    began = time.monotonic()
    # guarded() (bench/cli.py) needs of its context only cleanup().
    status = guarded(bench, run)  # type: ignore[arg-type]
    print_tables(bench.figures, args)
    if args.json:
        written = {
            "machine": machine(args),
            "options": {k: v for k, v in vars(args).items() if k != "json"},
            "targets": TARGETS,
            "status": status,
            **bench.figures,
        }
        Path(args.json).write_text(json.dumps(written, indent=2) + "\n")
    print(f"\ntotal {time.monotonic() - began:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
