"""README.md's tour runs as written: its Python blocks, in order, are one program that migrates,
writes an invoice with a command in one transaction, then runs the service until SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pika
import pytest
from sqlalchemy import create_engine, text

from helpers import wait_until

from .markdown_run import base_env, parse_blocks

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def tour_program() -> str:
    """The Python blocks of the README's section "A short tour", joined in order."""
    readme = README.read_text(encoding="utf-8")
    section = re.search(r"^## A short tour\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert section is not None, "README.md has no section '## A short tour'"
    blocks = [block.text for block in parse_blocks(section.group(1)) if block.lang == "python"]
    assert blocks, "the tour shows no Python"
    return "\n".join(blocks)


def send_command(mq_url: str, payload: dict[str, object]) -> None:
    """billing.invoice.create as a plain AMQP client would send it (docs/wire-format.md)."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "commands",
            "billing.invoice.create",
            json.dumps(payload).encode(),
            pika.BasicProperties(
                message_id=str(uuid.uuid4()), content_type="application/json", delivery_mode=2
            ),
            mandatory=True,
        )
    finally:
        connection.close()


def test_readme_tour_runs_as_written_on_real_servers(
    tmp_path: Path, db_url: str, mq_url: str
) -> None:
    program = tmp_path / "tour.py"
    program.write_text(tour_program(), encoding="utf-8")
    env = base_env(Path(sys.executable).parent)
    env.update(OUTBOX_INBOX_DB_URL=db_url, OUTBOX_INBOX_MQ_URL=mq_url)
    log_path = tmp_path / "tour.log"
    engine = create_engine(db_url)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(program)],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def alive() -> None:
            if process.poll() is not None:
                raise AssertionError(
                    f"the tour exited {process.returncode}: {log_path.read_text()}"
                )

        def published(routing_key: str) -> bool:
            alive()
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "SELECT count(*) FROM outbox_inbox.outbox_messages "
                            "WHERE routing_key = :key AND published_at IS NOT NULL"
                        ),
                        {"key": routing_key},
                    ).scalar_one()
                )

        def table_exists() -> bool:
            alive()
            with engine.connect() as conn:
                return conn.execute(text("SELECT to_regclass('invoices')")).scalar() is not None

        # The invoice written with its command in the tour's own transaction; the command
        # leaves once the service runs.
        wait_until(table_exists, timeout=60)
        wait_until(lambda: published("shipping.parcel.ship"), timeout=60)
        # The tour's command handler, on a command from outside.
        send_command(mq_url, {"order": 8})
        wait_until(lambda: published("billing.invoice.created"), timeout=60)
        with engine.connect() as conn:
            orders = conn.execute(text("SELECT order_id FROM invoices ORDER BY id")).scalars()
            assert list(orders) == [7, 8]

        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        engine.dispose()
