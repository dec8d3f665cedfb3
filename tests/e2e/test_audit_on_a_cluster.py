"""The audit runs unchanged on a Spark cluster: a real standalone master and worker (started
from PySpark's own launcher on loopback), the job submitted with ``spark-submit`` as in a
deployment. ``outbox-inbox audit --master spark://...`` builds the same session in client
mode; spark-submit is the path that adds the submit script on top.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from history import REPO_ROOT
from outbox_inbox.analytics.synthetic import Faults, generate
from servers import free_port

pyspark = pytest.importorskip("pyspark", reason="the audit needs the spark extra")

SPARK_HOME = Path(pyspark.__file__).parent
LOOPBACK = "127.0.0.1"


def _wait_for(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            break
        time.sleep(0.3)
    raise AssertionError(f"{text!r} not in {log} within {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[str]:
    """A standalone Spark master and one worker on loopback; its master URL. Both (and the
    executors the worker starts, in their process group) are killed afterwards."""
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_LOG_DIR": str(tmp_path),
        "PYSPARK_PYTHON": sys.executable,
    }
    port = free_port()
    url = f"spark://{LOOPBACK}:{port}"
    launcher = str(SPARK_HOME / "bin" / "spark-class")
    started: list[subprocess.Popen[bytes]] = []
    try:
        for name, args in (
            (
                "master",
                [
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--webui-port",
                    str(free_port()),
                ],
            ),
            (
                "worker",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    url,
                    "--host",
                    LOOPBACK,
                    "--cores",
                    "2",
                    "--memory",
                    "1g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    str(tmp_path / "work"),
                ],
            ),
        ):
            log = tmp_path / f"{name}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [launcher, *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append(process)
            ready = "I have been elected leader" if name == "master" else "Successfully registered"
            _wait_for(log, ready, process, timeout=90)
        yield url
    finally:
        for process in reversed(started):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_audit_submitted_to_a_standalone_cluster_reports_the_generated_counts(
    spark_cluster: str, tmp_path: Path
) -> None:
    expected = generate(
        tmp_path / "history", 3_000, Faults(lost=2, duplicates=3, dead=2, retried=2)
    )
    # The command line of a deployment, with only the master and sizes changed for the test.
    submit = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master",
            spark_cluster,
            "--conf",
            "spark.executor.memory=512m",
            "--conf",
            "spark.sql.shuffle.partitions=4",
            str(REPO_ROOT / "outbox_inbox" / "analytics" / "submit.py"),
            *expected.roots,
            "--out",
            str(tmp_path / "report"),
        ],
        env={
            **os.environ,
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_LOCAL_IP": LOOPBACK,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO_ROOT,
    )
    assert submit.returncode == 4, submit.stderr[-3000:]  # two messages lost: the check fails
    assert "FAILED: 2 lost" in submit.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["inputs"]["master"] == spark_cluster
    assert summary["totals"] == expected.totals
    # The executors ran the job: the worker started at least one for this application.
    assert list((tmp_path / "work").glob("app-*/*/stderr"))
