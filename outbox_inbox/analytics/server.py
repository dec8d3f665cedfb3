"""The warm local Spark: a Spark Connect server that ``outbox-inbox audit`` starts on first use
and later runs connect to, one per state directory (`state_dir`). docs/history.md ("A warm
Spark between runs") says what it keeps there, how it listens and when it stops itself."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .audit import AuditError, _first_line, spark_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def state_dir() -> Path:
    """Where the server's state and logs are (created, mode 0700)."""
    default = Path.home() / ".cache" / "outbox-inbox" / "spark"
    path = Path(os.environ.get("OUTBOX_INBOX_SPARK_DIR") or default)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def status() -> dict[str, Any] | None:
    """The running server's record (pid, jvm_pid, port, token, started_at, idle_seconds,
    spark), or None when none runs (a record left by a server that died is removed)."""
    record = state_dir() / "server.json"
    try:
        found: dict[str, Any] = json.loads(record.read_text())
        os.kill(int(found["pid"]), 0)
    except (OSError, ValueError, KeyError):
        record.unlink(missing_ok=True)
        return None
    return found


def stop(timeout: float = 60.0) -> dict[str, Any] | None:
    """Stop the running server (SIGTERM, SIGKILL after `timeout` s) and wait until its process
    is gone; return its record, or None when none ran."""
    found = status()
    deadline = time.monotonic() + timeout
    while found is not None and _alive(int(found["pid"])):
        os.kill(
            int(found["pid"]), signal.SIGKILL if time.monotonic() > deadline else signal.SIGTERM
        )
        time.sleep(0.2)
    (state_dir() / "server.json").unlink(missing_ok=True)
    return found


@contextmanager
def warm_session(driver_memory: str | None) -> Iterator[tuple[SparkSession, str]]:
    """A session on the running server (started first if none runs) and the line saying which;
    the server counts as used until the block ends. AuditError if it cannot start or be reached."""
    from pyspark.sql import SparkSession

    directory = state_dir()
    with (directory / "use.lock").open("a") as use:
        fcntl.flock(use, fcntl.LOCK_SH)  # the server does not stop while this is held
        with (directory / "start.lock").open("a") as start:
            fcntl.flock(start, fcntl.LOCK_EX)  # one start at a time
            found = status()
            verb = "reused" if found else "started"
            found = found or _start(directory, driver_memory)
        age = (datetime.now(UTC) - datetime.fromisoformat(found["started_at"])).total_seconds()
        line = (
            f"Spark: {verb} the local Spark Connect server (pid {found['pid']}, JVM "
            f"{found['jvm_pid']}, up {age:.0f}s; it stops after {found['idle_seconds']:.0f}s "
            "unused, or on `outbox-inbox audit --server stop`)"
        )
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        url = f"sc://localhost:{found['port']}/;token={found['token']}"
        try:
            spark = SparkSession.builder.remote(url).getOrCreate()
        except Exception as exc:  # grpc and pyspark errors of many kinds
            raise AuditError(f"the local Spark Connect server: {_first_line(exc)}") from exc
        try:
            yield spark, line
        finally:
            spark.stop()
            os.utime(use.name)


def _start(directory: Path, driver_memory: str | None) -> dict[str, Any]:
    """Start the server in its own session, detached; wait until it has written its record."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    idle = os.environ.get("OUTBOX_INBOX_SPARK_IDLE") or "600"
    try:
        float(idle)
    except ValueError:
        raise AuditError(f"OUTBOX_INBOX_SPARK_IDLE={idle!r} is not a number of seconds") from None
    log = directory / "server.log"
    with log.open("wb") as out:
        command = [sys.executable, "-m", __name__, str(port), idle, driver_memory or ""]
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    deadline = time.monotonic() + 300  # a cold JVM on a loaded machine
    while process.poll() is None and time.monotonic() < deadline:
        if (directory / "server.json").exists():
            return dict(json.loads((directory / "server.json").read_text()))
        time.sleep(0.2)
    process.kill()
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise AuditError(f"the local Spark Connect server did not start ({log}): {tail[0][:300]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return os.waitpid(pid, os.WNOHANG) == (0, 0)  # a child of ours that exited is a zombie
    except ChildProcessError:
        return True
    except ProcessLookupError:
        return False


def _serve(port: int, idle: float, driver_memory: str) -> None:
    """The server's process: Spark with the Connect plugin until SIGTERM or `idle` s unused."""
    directory, done = state_dir(), threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: done.set())
    token = secrets.token_urlsafe(24)
    plugin = "org.apache.spark.sql.connect.SparkConnectPlugin"
    spark = spark_session(
        "local[*]",
        driver_memory=driver_memory or None,
        config={
            "spark.plugins": plugin,
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(port),
            "spark.connect.authenticate.token": token,
        },
    )
    use = directory / "use.lock"
    use.touch()
    jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    record = {"pid": os.getpid(), "jvm_pid": int(jvm), "port": port, "token": token}
    record.update(started_at=datetime.now(UTC).isoformat(), idle_seconds=idle, spark=spark.version)
    written = directory / "server.json.new"
    written.write_text(json.dumps(record))
    written.chmod(0o600)
    written.replace(directory / "server.json")
    with use.open("a") as lock:
        while not done.wait(min(idle / 4, 5.0)):
            if time.time() - use.stat().st_mtime < idle:
                continue
            with suppress(BlockingIOError):  # held: an audit runs, and touches it when it ends
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break  # no audit holds it: stop
        (directory / "server.json").unlink(missing_ok=True)
    jvm_process = spark.sparkContext._gateway.proc  # type: ignore[union-attr]
    spark.stop()
    jvm_process.stdin.close()  # the JVM exits at its pipe's end: wait for it, not orphan it
    jvm_process.wait()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
