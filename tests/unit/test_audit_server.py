"""The warm audit: repeated ``outbox-inbox audit`` runs share one local Spark Connect server
(the second starts no JVM), which stops on ``--server stop`` and by itself when unused; and
what fails before Spark starts, with no JVM started (a ``java`` that records being run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from history import cli
from outbox_inbox.analytics.synthetic import Faults, generate

pyspark = pytest.importorskip("pyspark", reason="the audit needs the spark extra")


def _java_children(pid: int) -> set[int]:
    """The java processes whose parent is `pid`, from the process table."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if name == "java" and int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def fake_java(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``java`` (JAVA_HOME's and PATH's) records that it ran, and fails."""
    home, ran = tmp_path / "fake-java", tmp_path / "java-ran"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    java.chmod(0o755)
    env = {"JAVA_HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}"}
    return env, ran


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a warm audit with its own state directory; the server it starts is
    stopped afterwards, and no JVM of it is left."""
    env = {
        "OUTBOX_INBOX_SPARK_SERVER": "warm",
        "OUTBOX_INBOX_SPARK_DIR": str(tmp_path / "spark"),
        "OUTBOX_INBOX_SPARK_IDLE": "600",
    }
    yield env
    record = tmp_path / "spark" / "server.json"
    found = json.loads(record.read_text()) if record.exists() else None
    cli("audit", "--server", "stop", env=env)
    if found is not None:
        assert not _alive(found["pid"]) and not _alive(found["jvm_pid"])


def test_a_second_audit_reuses_the_running_server_and_starts_no_jvm(
    warm: dict[str, str], fake_java: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    expected = generate(tmp_path / "history", 2_000, Faults(lost=2, duplicates=3, dead=2))
    first = cli("audit", *expected.roots, "--out", str(tmp_path / "r1"), "--json", env=warm)
    assert first.returncode == 4, first.stderr[-3000:]
    assert "Spark: started the local Spark Connect server" in first.stderr
    status = json.loads(cli("audit", "--server", "status", "--json", env=warm).stdout)
    assert _java_children(status["pid"]) == {status["jvm_pid"]}
    assert "token" not in status

    env, ran = fake_java
    second = cli(
        "audit", *expected.roots, "--out", str(tmp_path / "r2"), "--json", env={**warm, **env}
    )
    assert second.returncode == 4, second.stderr[-3000:]
    assert not ran.exists()  # no java was run by the second audit
    assert f"Spark: reused the local Spark Connect server (pid {status['pid']}," in second.stderr
    assert _java_children(status["pid"]) == {status["jvm_pid"]}
    assert json.loads(second.stdout)["totals"] == json.loads(first.stdout)["totals"]
    assert json.loads(second.stdout)["totals"] == expected.totals

    stopped = cli("audit", "--server", "stop", "--json", env=warm)
    assert json.loads(stopped.stdout)["pid"] == status["pid"]
    assert not _alive(status["pid"]) and not _alive(status["jvm_pid"])
    assert "no server runs" in cli("audit", "--server", "status", env=warm).stdout


def test_the_server_stops_itself_when_no_audit_used_it_for_its_idle_time(
    warm: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "archive").mkdir()
    env = {**warm, "OUTBOX_INBOX_SPARK_IDLE": "2"}
    done = cli("audit", str(tmp_path / "archive"), "--out", str(tmp_path / "r"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # It may be gone before a status could ask: the run's own line names its processes.
    started = re.search(r"server \(pid (\d+), JVM (\d+), up \d+s; it stops after 2s", done.stderr)
    assert started, done.stderr
    pid, jvm_pid = int(started[1]), int(started[2])
    for _ in range(600):  # a bounded wait for what it does by itself; nothing is timed
        if not _alive(pid) and not _alive(jvm_pid):
            break
        time.sleep(0.5)
    assert not _alive(pid) and not _alive(jvm_pid)
    assert not (tmp_path / "spark" / "server.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--day", "2026-12-24"), "no archive partition holds the day 2026-12-24 or a later one"),
        (("--since", "2026-11-10", "--until", "2026-11-09"), "the audit window is empty"),
        (("--day", "2026-11-10T05:00"), "is not a day like 2026-11-25"),
    ],
)
@pytest.mark.parametrize("server", ["warm", "none"])
def test_errors_the_archive_listing_tells_come_in_one_line_before_any_jvm_starts(
    fake_java: tuple[dict[str, str], Path],
    tmp_path: Path,
    args: tuple[str, ...],
    message: str,
    server: str,
) -> None:
    generate(tmp_path / "history", 200, Faults())
    env, ran = fake_java
    env = {**env, "OUTBOX_INBOX_SPARK_SERVER": server, "OUTBOX_INBOX_SPARK_DIR": str(tmp_path)}
    result = cli("audit", str(tmp_path / "history" / "orders"), *args, env=env)
    assert result.returncode in (1, 2), result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 4  # with click's usage, for a bad option
    assert not ran.exists()
    assert not (tmp_path / "server.json").exists()


def test_a_root_that_cannot_be_listed_is_an_error_before_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox_inbox.analytics import audit

    def refuse(path: str) -> list[str]:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(audit.os, "listdir", refuse)
    with pytest.raises(audit.AuditError, match=f"archive {tmp_path} cannot be read: Permission"):
        audit.check_archives([str(tmp_path)], None)


_PARTS = """
import json, sys
from outbox_inbox.analytics import audit, server
with server.warm_session(None) as (spark, _):
    outbox, inbox, _ = audit._read_inputs(spark, sys.argv[1:], [], None)
    most = int(spark.conf.get("spark.sql.shuffle.partitions"))
    print(json.dumps({"parts": audit._parts(spark, outbox, inbox), "most": most}))
"""


def test_the_warm_server_spreads_a_small_history_into_as_few_parts_as_a_one_shot_session(
    warm_spark: dict[str, str], tmp_path: Path
) -> None:
    # Spark Connect gives no size estimate: the local files read give it. Without one, every
    # audit on the server ran in spark.sql.shuffle.partitions parts (a day's audit of the 3M
    # month: 2.9 s in 8 parts, 2.2 s in 2).
    expected = generate(tmp_path / "history", 2_000, Faults())
    env = {**os.environ, **warm_spark}
    done = subprocess.run(
        [sys.executable, "-c", _PARTS, *expected.roots], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    if (os.cpu_count() or 1) >= found["most"]:
        pytest.skip("as many CPUs as shuffle parts: the least and the most are one")
    assert found["parts"] == os.cpu_count()  # the parallelism: the history is a few kB
