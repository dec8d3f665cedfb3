"""The test fixtures give real, working, isolated servers (and local ones survive restarts)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pika
import pika.exceptions
import pytest
import sqlalchemy as sa
from pika.adapters.blocking_connection import BlockingChannel

from servers import PostgresServer, RabbitMQServer


def _channel(url: str) -> tuple[pika.BlockingConnection, BlockingChannel]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    return connection, connection.channel()


def _get_body(channel: BlockingChannel, queue: str) -> bytes | None:
    method, _properties, body = channel.basic_get(queue, auto_ack=True)
    return None if method is None else body


def test_db_url_answers_a_query(db_url: str) -> None:
    assert db_url.startswith("postgresql+psycopg://")
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one().startswith("t_")
    finally:
        engine.dispose()


def test_db_url_factory_makes_distinct_empty_databases(
    db_url: str, db_url_factory: Callable[[], str]
) -> None:
    other = db_url_factory()
    assert other != db_url
    engines = [sa.create_engine(db_url), sa.create_engine(other)]
    try:
        with engines[0].begin() as conn:
            conn.execute(sa.text("CREATE TABLE only_here (id int)"))
        with engines[1].connect() as conn:
            assert conn.execute(sa.text("SELECT to_regclass('only_here')")).scalar() is None
    finally:
        for engine in engines:
            engine.dispose()


def test_mq_url_publish_and_get(mq_url: str) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    connection, channel = _channel(mq_url)
    try:
        channel.queue_declare(queue, durable=False, auto_delete=False)
        channel.basic_publish("", queue, b"hello")
        for _ in range(50):  # publish is asynchronous: give the broker a moment to route it
            body = _get_body(channel, queue)
            if body is not None:
                break
            connection.sleep(0.05)
        assert body == b"hello"
        channel.queue_delete(queue)
    finally:
        connection.close()


def test_mq_url_vhosts_isolate_tests(rabbitmq_server: object, mq_url: str) -> None:
    if not isinstance(rabbitmq_server, RabbitMQServer):
        pytest.skip("external RabbitMQ: tests share its default vhost")
    vhost = pika.URLParameters(mq_url).virtual_host
    assert vhost.startswith("t_")
    _channel(mq_url)[0].close()  # the vhost exists: a connection to it opens
    connection, channel = _channel(rabbitmq_server.url)
    try:  # a queue in the test's vhost is not visible from the default vhost
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            channel.queue_declare(f"absent-{uuid.uuid4().hex[:8]}", passive=True)
    finally:
        if connection.is_open:
            connection.close()


def test_rabbitmq_restart_keeps_durable_queue_and_persistent_message(
    local_rabbitmq_server: RabbitMQServer, mq_url: str
) -> None:
    server = local_rabbitmq_server
    queue = f"durable-{uuid.uuid4().hex[:8]}"
    connection, channel = _channel(mq_url)
    channel.confirm_delivery()
    channel.queue_declare(queue, durable=True)
    channel.basic_publish(
        "", queue, b"survives", pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
    )
    connection.close()

    port = server.port
    server.stop()
    assert not server.running
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(mq_url + "?connection_attempts=1"))
    server.start()
    assert server.port == port

    connection, channel = _channel(mq_url)
    try:
        assert _get_body(channel, queue) == b"survives"
        channel.queue_delete(queue)
    finally:
        connection.close()


def test_rabbitmq_kill_and_start_again(local_rabbitmq_server: RabbitMQServer, mq_url: str) -> None:
    server = local_rabbitmq_server
    queue = f"durable-{uuid.uuid4().hex[:8]}"
    connection, channel = _channel(mq_url)
    channel.confirm_delivery()
    channel.queue_declare(queue, durable=True)
    channel.basic_publish(
        "", queue, b"confirmed", pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
    )
    connection.close()
    # Without this, a SIGKILL right after the declaration can lose the queue (see its doc).
    server.flush_metadata()

    server.kill()
    assert not server.running
    server.start()

    connection, channel = _channel(mq_url)
    try:  # a confirmed persistent message is on disk, even after SIGKILL
        assert _get_body(channel, queue) == b"confirmed"
        channel.queue_delete(queue)
    finally:
        connection.close()


def test_postgres_restart_keeps_committed_rows(
    local_postgres_server: PostgresServer, db_url: str
) -> None:
    server = local_postgres_server
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE kept (v text)"))
            conn.execute(sa.text("INSERT INTO kept VALUES ('committed')"))
        engine.dispose()

        port = server.port
        server.stop()
        assert not server.running
        with pytest.raises(sa.exc.OperationalError), engine.connect():
            pass
        server.start()
        assert server.port == port

        engine.dispose()  # the pool's connections died with the server
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT v FROM kept")).scalars().all() == ["committed"]
    finally:
        engine.dispose()


def test_postgres_kill_keeps_committed_rows(
    local_postgres_server: PostgresServer, db_url: str
) -> None:
    server = local_postgres_server
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE kept (v text)"))
            conn.execute(sa.text("INSERT INTO kept VALUES ('committed')"))
        open_conn = engine.connect()
        open_conn.execute(sa.text("INSERT INTO kept VALUES ('uncommitted')"))

        server.kill()  # crash with a transaction in flight: recovery must drop it
        assert not server.running
        server.start()

        open_conn.invalidate()
        engine.dispose()
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT v FROM kept")).scalars().all() == ["committed"]
    finally:
        engine.dispose()
