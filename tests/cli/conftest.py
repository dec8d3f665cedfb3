"""Fixtures of the CLI tests: the real `outbox-inbox` command as a subprocess, and a service."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # `cli_app` is a plain module next to this file
    sys.path.insert(0, str(_HERE))

import cli_app  # noqa: E402
from cli_support import Cli, Result, base_env, command  # noqa: E402

from outbox_inbox import Service  # noqa: E402


@pytest.fixture
def cli_env(db_url: str, mq_url: str, rabbitmq_server: Any, tmp_path: Path) -> dict[str, str]:
    """The environment of the command: the app's URLs, the management API, an audit log."""
    env = {
        cli_app.DB_ENV: db_url,
        cli_app.MQ_ENV: mq_url,
        "OUTBOX_INBOX_AUDIT_LOG": str(tmp_path / "audit.log"),
    }
    management_url = getattr(rabbitmq_server, "management_url", None)
    if management_url:
        env["OUTBOX_INBOX_MANAGEMENT_URL"] = management_url
    return env


@pytest.fixture
def cli(cli_env: dict[str, str], tmp_path: Path) -> Cli:
    """Run ``outbox-inbox ARGS`` to the end; returns a Result (never raises on exit codes)."""

    def run(
        *args: str,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> Result:
        completed = subprocess.run(
            command(*args),
            cwd=tmp_path,
            env=base_env({**cli_env, **(env or {})}),
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Result(tuple(args), completed.returncode, completed.stdout, completed.stderr)

    return run


@pytest.fixture
def spawn(
    cli_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``outbox-inbox ARGS`` in the background; killed at teardown if still running."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            command(*args),
            cwd=tmp_path,
            env=base_env(cli_env),
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
                process.kill()
            process.wait(timeout=10)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def make_service(db_url: str, mq_url: str) -> Iterator[Callable[..., Service]]:
    """Build a `cli_app` service on the test's database and vhost, prepared; closed after."""
    built: list[Service] = []

    def make(name: str = "billing", **settings: Any) -> Service:
        service = cli_app.build(name, db_url, mq_url, **settings)
        cli_app.prepare(service)
        built.append(service)
        return service

    try:
        yield make
    finally:
        for service in reversed(built):
            service.close()
