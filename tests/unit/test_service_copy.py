"""`Service.with_urls`: the service on other servers, and what the copy keeps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from outbox_inbox import Listener, Message, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.database import connect


def test_with_urls_is_the_service_itself_when_no_url_is_another(tmp_path: Path) -> None:
    app = Service("billing", db_url=f"sqlite:///{tmp_path / 'a.db'}")
    assert app.with_urls() is app
    assert app.with_urls(db_url=app.settings.db_url) is app


def test_with_urls_keeps_name_settings_handlers_listener_and_a_given_broker(
    tmp_path: Path,
) -> None:
    listener = Listener()
    with MemoryBroker() as broker:
        app = Service(
            "billing",
            db_url=f"sqlite:///{tmp_path / 'a.db'}",
            broker=broker,
            listener=listener,
            worker_threads=3,
            relay_batch_size=7,
        )

        @app.on_command("invoice.create")
        def create(message: Message, session: object) -> None: ...

        other = f"sqlite:///{tmp_path / 'b.db'}"
        copy = app.with_urls(db_url=other)
        try:
            assert copy is not app and copy.name == "billing"
            assert copy.settings == replace(app.settings, db_url=other)
            assert copy.handlers is app.handlers and copy.listener is listener
            assert copy.broker is broker
            assert str(copy.engine.url) == other and copy.engine is not app.engine
        finally:
            copy.close()
            app.close()


def test_with_urls_keeps_a_given_engine_when_only_the_broker_is_another(tmp_path: Path) -> None:
    engine = connect(f"sqlite:///{tmp_path / 'a.db'}").engine
    app = Service("billing", engine=engine)
    copy = app.with_urls(mq_url="amqp://guest:secret@localhost:5672/")
    try:
        assert copy.engine is engine
        assert copy.settings.mq_url == "amqp://guest:secret@localhost:5672/"
        assert copy.broker.description == "amqp://guest:***@localhost:5672/"
    finally:
        engine.dispose()
