"""The CLI's boundary: a database error the library lets through ends the command with one
line, the library's own (`errors.escaped_error`), exit 1, no traceback, no password."""

from __future__ import annotations

from click.testing import CliRunner

from outbox_inbox.cli.main import main

NOBODY_LISTENS = "postgresql+psycopg://app:s3cretpw@127.0.0.1:1/orders"


def test_a_database_the_command_cannot_reach_is_one_database_error_line_and_exit_1() -> None:
    result = CliRunner().invoke(main, ["partitions", "list", "--db-url", NOBODY_LISTENS])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: database error: "), line
    assert "127.0.0.1" in line and "s3cretpw" not in line
