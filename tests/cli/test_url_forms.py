"""One URL policy for the library and the command: every command that takes --db-url takes
``postgresql://``, ``postgres://`` and ``postgresql+psycopg://`` (read as psycopg 3, as
``Service(db_url=...)`` reads them), and refuses another driver in one line, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import Cli

FORMS = ("postgresql+psycopg://", "postgresql://", "postgres://")


def _commands(url: str, tmp_path: Path) -> list[tuple[str, ...]]:
    """A command of each group that reads the database, with `url`."""
    db = ("--db-url", url)
    return [
        ("db", "upgrade", *db),
        ("db", "current", *db),
        ("db", "check", *db),
        ("status", "--service", "billing", *db),
        ("dead-letters", "list", "--service", "billing", "--source", "all", *db),
        ("dead-letters", "count", "--service", "billing", "--source", "all", *db),
        ("partitions", "list", *db),
        ("archive", "--service", "billing", "--to", str(tmp_path / "archive"), "--dry-run", *db),
    ]


@pytest.mark.parametrize("form", FORMS)
def test_every_command_takes_each_postgresql_url_form(
    cli: Cli, db_url: str, tmp_path: Path, form: str
) -> None:
    url = form + db_url.split("://", 1)[1]
    for args in _commands(url, tmp_path):
        result = cli(*args)
        assert result.returncode == 0, result
        assert "Traceback" not in result.output and "error" not in result.stderr, result


def test_an_unsupported_driver_is_one_line_in_every_command(cli: Cli, tmp_path: Path) -> None:
    schemes = ["postgresql+psycopg2", "mysql", "postgresql+asyncpg"]
    for n, args in enumerate(_commands("", tmp_path)):
        url = f"{schemes[n % len(schemes)]}://user:Secret9x@db.example:5432/x"
        result = cli(*args[:-1], url)
        assert result.returncode == 1, result
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: database URL ") and "is not supported" in line, result
        assert "Secret9x" not in result.output, result
