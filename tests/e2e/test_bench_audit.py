"""bench/audit.py runs each of its groups to the end on tiny histories, writes every figure to
its JSON, and leaves no Spark master, worker or executor behind, also when interrupted.

The figures themselves are the bench's business (bench/README.md); these tests prove that the
bench measures what it says it does, and cleans up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from history import REPO_ROOT

pytest.importorskip("pyspark", reason="the audit needs the spark extra")

BENCH = REPO_ROOT / "bench" / "audit.py"


def _cluster_processes(directory: Path) -> dict[int, str]:
    """The live processes the bench's cluster started under `directory` (the master, the
    workers and their executors all inherit its SPARK_LOG_DIR): pid -> command line."""
    marker = f"SPARK_LOG_DIR={directory / 'cluster'}".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker in environ:
            found[int(entry.name)] = cmdline.decode(errors="replace")
    return found


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(900)
def test_bench_audit_runs_every_group_with_exact_counts_and_spark_metrics(tmp_path: Path) -> None:
    histories, figures = tmp_path / "histories", tmp_path / "audit.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--cold-sizes",
            "3000",
            "--sizes",
            "3000",
            "--month-messages",
            "20000",
            "--cluster-size",
            "3000",
            "--repeat",
            "1",
            # The untimed warm-up round, of which nothing is asserted, and every 3-day group on
            # one history (histories are keyed by size and days): generated once, and the
            # warm-up audits (one local, one per cluster application) read 3,000 messages
            # instead of 20,000. The groups still run their warm-up, then their timed runs
            # with exact counts, as at any size.
            "--warm-up",
            "3000",
            "--driver-memory",
            "1g",
            "--worker-memory",
            "1g",
            "--cluster-conf",
            "spark.sql.shuffle.partitions=4",
            "--dir",
            str(histories),
            "--json",
            str(figures),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["machine"]["cpus"] == os.cpu_count()
    assert result["machine"]["driver_memory"] == "1g"

    [cold] = result["cold"]
    assert cold["messages"] == 3000 and cold["totals_exact"]
    assert len(cold["runs_s"]) == 2 and all(s > 0 for s in cold["runs_s"])
    # The cold join baseline, and the CLI's first (server started) and repeated runs against it.
    assert len(cold["cold_join_s"]) == 2 and all(s > 0 for s in cold["cold_join_s"])
    assert cold["repeated_over_cold_join"] == round(cold["runs_s"][1] / cold["cold_join_s"][1], 3)

    [warm] = result["warm"]
    assert warm["counts_exact"]
    assert warm["audit_over_join"] == round(warm["join"]["s"] / warm["audit"]["s"], 3)
    assert warm["audit"]["jvm_cpu_s"] > 0  # read from the JVM's /proc entry
    assert warm["audit_cpu_us_per_row"] > 0

    incremental = result["incremental"]
    assert incremental["days"] == 30
    assert incremental["day"] == "2026-11-30"  # the last full day before the history's now
    assert incremental["days_read"] == ["2026-11-30"]  # the later days hold nothing
    assert incremental["day_totals"]["sent"] > 0
    day, full = incremental["one_day"]["s"], incremental["full"]["s"]
    assert incremental["day_over_full"] == round(day / full, 3)
    combined = incremental["combined"]["s"]  # its totals equal the month's, or the bench fails
    assert incremental["combined_over_full"] == round(combined / full, 4)
    assert incremental["day_results_s"] > 0

    cluster = result["cluster"]
    assert [r["workers"] for r in cluster["runs"]] == [1, 2]
    assert cluster["conf"] == {"spark.sql.shuffle.partitions": "4"}
    for run in cluster["runs"]:
        assert run["counts_exact"] and run["shuffle_partitions"] == 4
        assert run["jobs"] > 0 and run["stages"] == len(run["per_stage"]) > 0
        assert 0 < run["shuffles"] <= run["stages"]
        assert run["executor_cpu_s"] > 0
        assert run["cpu_s"]["workers_and_executors"] > 0
    assert _cluster_processes(histories) == {}


@pytest.mark.timeout(300)
def test_bench_audit_interrupted_on_the_cluster_kills_master_workers_and_executors(
    tmp_path: Path,
) -> None:
    histories = tmp_path / "histories"
    bench = subprocess.Popen(
        [
            sys.executable,
            str(BENCH),
            "--only",
            "cluster",
            "--cluster-size",
            "200000",
            "--driver-memory",
            "1g",
            "--worker-memory",
            "1g",
            "--dir",
            str(histories),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert bench.stdout is not None
    try:
        # Ctrl-C while a Spark job runs: once the executor has computed for a few seconds,
        # it is in the warm-up audit or the timed one.
        deadline = time.monotonic() + 180
        while True:
            assert bench.poll() is None, bench.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no executor computed"
            executors = [
                pid
                for pid, command in _cluster_processes(histories).items()
                if "CoarseGrainedExecutorBackend" in command
            ]
            with contextlib.suppress(OSError):
                if executors and _cpu_seconds(executors[0]) > 5:
                    break
            time.sleep(0.2)
        bench.send_signal(signal.SIGINT)
        output, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        left = _cluster_processes(histories)
        for pid in left:  # so that a failure here leaves nothing running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert bench.returncode == 130, output.decode()[-3000:]
    assert "interrupted; cleaning up" in output.decode()
    assert left == {}
