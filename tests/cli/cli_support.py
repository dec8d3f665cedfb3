"""Running the real `outbox-inbox` command as a subprocess, for the CLI tests.

The command runs as ``python -m outbox_inbox.cli.main`` (the console script's module) with a
clean environment: the test servers' URLs reach it only through the options or the variables a
test passes, and ``--app cli_app:billing`` finds tests/cli/cli_app.py through PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Variables of the command that the tests' own environment must not leak into it.
_CLEARED = (
    "OUTBOX_INBOX_DB_URL",
    "OUTBOX_INBOX_MQ_URL",
    "OUTBOX_INBOX_MANAGEMENT_URL",
    "OUTBOX_INBOX_AUDIT_LOG",
)


@dataclass(frozen=True)
class Result:
    """What a run of the command did."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return (
            f"outbox-inbox {' '.join(self.args)} -> exit {self.returncode}\n"
            f"--- stdout:\n{self.stdout}--- stderr:\n{self.stderr}"
        )


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_inbox.cli.main", *args]


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


Cli = Callable[..., Result]
