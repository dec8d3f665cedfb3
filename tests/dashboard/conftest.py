"""Fixtures of the dashboard tests: a service with its roles running, the real
`outbox-inbox dashboard` command, and a headless Chromium session."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_CLI_TESTS = _HERE.parent / "cli"
for path in (_HERE, _CLI_TESTS):  # browser.py here; the CLI tests' app and command runner
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import cli_app  # noqa: E402
from browser import Browser  # noqa: E402
from cli_support import base_env, command  # noqa: E402
from dash_support import RunningDashboard  # noqa: E402

from outbox_inbox import Service  # noqa: E402


@pytest.fixture
def dash_env(db_url: str, mq_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        cli_app.DB_ENV: db_url,
        cli_app.MQ_ENV: mq_url,
        "OUTBOX_INBOX_AUDIT_LOG": str(tmp_path / "audit.log"),
    }


@pytest.fixture
def billing(db_url: str, mq_url: str) -> Iterator[Service]:
    """The CLI tests' `billing` service on this test's database and vhost, migrated, its
    topology declared (so commands reach its queue before its roles run)."""
    service = cli_app.build("billing", db_url, mq_url)
    cli_app.prepare(service)
    service.declare_topology()
    try:
        yield service
    finally:
        service.close()


@pytest.fixture
def spawn(
    dash_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``outbox-inbox ARGS``; SIGTERM, then SIGKILL, at teardown if still running."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            command(*args),
            cwd=tmp_path,
            env=base_env({**dash_env, **(env or {})}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def start_dashboard(
    spawn: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> Callable[..., RunningDashboard]:
    """Start `outbox-inbox dashboard --app cli_app:billing --port 0 ARGS` and wait for its URL."""

    def start(*args: str, env: Mapping[str, str] | None = None) -> RunningDashboard:
        process = spawn(
            "dashboard", "--app", "cli_app:billing", "--port", "0", "--refresh", "0", *args, env=env
        )
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"dashboard on (http://\S+/)", line)
        if not match:
            process.kill()
            errors = process.stderr.read() if process.stderr else ""
            raise AssertionError(f"the dashboard did not start: {line!r}\n{errors}")
        return RunningDashboard(process, match[1], tmp_path / "audit.log")

    return start


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    session = Browser(tmp_path)
    try:
        yield session
    finally:
        session.close()
