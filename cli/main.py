"""`outbox-inbox`: migrations, topology, dead letters, status, tail, running roles, history,
partitions.

Every command prints one ``error: ...`` line on stderr and exits 1 on bad input, an unreachable
server, missing tables or an unknown app (``-v`` adds the traceback). Passwords are masked in
everything printed or logged. Exit codes are listed in docs/cli.md.

This module imports click and the CLI's output helpers only: each command's module (and with
it SQLAlchemy, psycopg and pika) is imported when that command runs, so ``--version`` and
``--help`` answer at once.
"""

from __future__ import annotations

import importlib
import re
import sys
import traceback
from typing import Any
from urllib.parse import unquote, urlsplit

import click

from .output import EXIT_ERROR, VERBOSE, configure_logging, echo, mask, more_verbose, verbosity

__all__ = ["main"]

#: The commands: name -> (module of cli/, the line `outbox-inbox --help` shows); the command is
#: the module's attribute of the name, with "_" for "-".
COMMANDS: dict[str, tuple[str, str]] = {
    "archive": ("history", "Move finished messages older than the retention into Parquet."),
    "audit": ("history", "Reconcile sent and received messages on Spark; write a report."),
    "dashboard": ("dashboard", "Serve the web dashboard: status, rates, dead letters."),
    "db": ("db", "Create, upgrade and inspect the outbox/inbox tables."),
    "dead-letters": ("dead_letters", "List, show, replay and purge dead letters."),
    "demo": ("demo", "Run two example services (orders, billing) and print a trace."),
    "partitions": (
        "partitions",
        "List the time partitions; make, export and drop them in one pass.",
    ),
    "run": ("run", "Run the relay, receiver, worker or all of them until SIGTERM."),
    "status": ("status", "Backlog, inbox states and held-back keys; a health check."),
    "tail": ("tail", "Print messages matching a topic pattern, live."),
    "topology": ("topology", "Plan, apply and verify the broker objects a service needs."),
}

_VERBOSE_HELP = "More log output (-vv for debug); tracebacks."


def _expected(exc: Exception) -> BaseException | None:
    """`exc` if it ends a command with one line instead of a traceback, as the library's own
    error where it is a database or broker error the library let through; else None.
    (Imported when one happens: the command that raised it has imported them already.)"""
    from alembic.util.exc import CommandError

    from outbox_inbox.errors import OutboxInboxError, escaped_error

    if isinstance(exc, OutboxInboxError | CommandError | OSError):
        return exc
    return escaped_error(exc)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong (masked by the caller's echo)."""
    from alembic.util.exc import CommandError

    from outbox_inbox.errors import BrokerAccessRefused, OutboxInboxError

    if isinstance(exc, BrokerAccessRefused):
        refused = _vhost_refused(exc)
        if refused:
            return refused
    text = str(exc).strip() or repr(exc)
    first = text.splitlines()[0]
    if isinstance(exc, OutboxInboxError | CommandError):
        return first
    return f"{type(exc).__name__}: {first}"


def _vhost_refused(exc: BaseException) -> str | None:
    """A login RabbitMQ refused at the virtual host, in one line naming the vhost and user.

    Once it has accepted the credentials, RabbitMQ answers Connection.Open for a vhost that
    does not exist, or that the user may not open, with ``530 NOT_ALLOWED`` (``vhost X not
    found`` / ``access to vhost 'X' refused for user 'Y'``); the library's message quotes it
    after the (masked) URL, whose vhost and user are named here.
    """
    if "NOT_ALLOWED" not in str(exc):
        return None
    found = re.search(r"RabbitMQ at (\S+) refused", str(exc))
    if found is None:
        return None
    where = found[1].split(",")[0]
    url = urlsplit(where)
    vhost = unquote(url.path[1:]) or "/"
    user = unquote(url.username or "guest")  # pika's default user
    return (
        f"cannot connect to RabbitMQ at {where}: vhost {vhost} does not exist "
        f"(or user {user} may not access it)"
    )


def _masked(exc: click.ClickException) -> click.ClickException:
    """`exc`, or the same error with the passwords of its message masked."""
    message = mask(exc.message)
    if message == exc.message:
        return exc
    if isinstance(exc, click.UsageError):  # exit code 2, as every usage error
        return click.UsageError(message, exc.ctx)
    return click.ClickException(message)


def _accept_verbose(command: click.Command) -> click.Command:
    """`command` and its subcommands take -v / -vv too (``outbox-inbox status -v``)."""
    if not any(param.name == "verbose" for param in command.params):
        command.params.append(
            click.Option(
                ["-v", "--verbose"],
                count=True,
                expose_value=False,
                callback=more_verbose,
                help=_VERBOSE_HELP,
            )
        )
    if isinstance(command, click.Group):
        for subcommand in command.commands.values():
            _accept_verbose(subcommand)
    return command


class _Commands(click.Group):
    """The root group: loads a command when it is used, and turns the errors an operator can
    cause into one line and exit 1."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, short_help = COMMANDS[cmd_name]
        imported = importlib.import_module(f".{module}", __package__)
        command: click.Command = getattr(imported, cmd_name.replace("-", "_"))
        command.short_help = short_help
        return _accept_verbose(command)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # From the table, not the commands: listing them must not import them.
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:  # a URL given where a command was expected
            raise _masked(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:  # usage errors quote what was typed
            raise _masked(exc) from None
        except Exception as exc:
            error = _expected(exc)
            if error is None:
                raise
            if verbosity(ctx):
                echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
            echo(f"error: {describe(error)}", err=True)
            sys.exit(EXIT_ERROR)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help=_VERBOSE_HELP)
@click.version_option(package_name="outbox-inbox", prog_name="outbox-inbox")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Operate the transactional outbox and inbox of services on PostgreSQL and RabbitMQ.

    \b
    Commands take the servers they use from --db-url / --mq-url (or the environment
    variables OUTBOX_INBOX_DB_URL / OUTBOX_INBOX_MQ_URL), or from your Service with
    --app module:attribute. Output is a plain table; --json prints JSON for scripts.
    Passwords are masked in all output and logs. `outbox-inbox COMMAND --help` for more.
    -v / -vv may also follow the command (`outbox-inbox status -v`).
    """
    ctx.meta[VERBOSE] = verbose
    configure_logging(verbose)


if __name__ == "__main__":
    main(prog_name="outbox-inbox")
