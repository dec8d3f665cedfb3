"""`outbox-inbox demo`."""

from __future__ import annotations

import logging
import sys

import click

from outbox_inbox.config import DB_URL_ENV, MQ_URL_ENV
from outbox_inbox.demo import run_demo

from .output import echo


@click.command()
@click.option("--db-url", envvar=DB_URL_ENV, help="Run on this database instead of SQLite files.")
@click.option("--mq-url", envvar=MQ_URL_ENV, help="Run on this RabbitMQ instead of in memory.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the end.")
def demo(db_url: str | None, mq_url: str | None, timeout: float) -> None:
    """Run two example services (orders, billing) and print what happens, step by step.

    With no URLs it needs no server: each service has a SQLite file in a temporary
    directory and both use the in-memory broker. The trace shows a command and an event
    leaving with the transaction that wrote them, a rolled-back order sending nothing, a
    handler failing once and being retried, and a message rejected into the dead letters.
    """
    # The trace tells the story; the roles' own warnings (the retry, the rejection, the
    # in-memory broker) would repeat it out of order.
    library = logging.getLogger("outbox_inbox")
    level = library.level
    if not logging.getLogger().isEnabledFor(logging.INFO):
        library.setLevel(logging.ERROR)
    try:
        ok = run_demo(db_url=db_url, mq_url=mq_url, echo=echo, timeout=timeout)
    finally:
        library.setLevel(level)
    if not ok:
        echo("error: the demo did not finish in time", err=True)
        sys.exit(1)
