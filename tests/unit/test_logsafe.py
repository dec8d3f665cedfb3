"""Passwords are masked in every shape of URL a user may type, and parsers' errors leak none."""

from __future__ import annotations

import logging
import traceback

import pytest

from outbox_inbox import ConfigurationError, Service
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.logsafe import mask_text, mask_url, url_passwords
from outbox_inbox.management import ManagementAPI

#: Malformed and valid URLs, each with a password of its own; "{pw}" is where it goes.
SHAPES = [
    "postgresql+psycopg://u:{pw}@db:5432/x",
    "postgresql+psycopg//u:{pw}@db/x",  # a missing ":"
    "postgresql+psycopg:/u:{pw}@db/x",  # a missing "/"
    "postgresql+psycopg:u:{pw}@db/x",
    "u:{pw}@db/x",  # no scheme
    "amqp://u:{pw}",  # no host: the password reads as a port
    "amqp://u:{pw}/vhost",
    "amqp//u:{pw}@rabbit:5672/%2F",
    "http//u:{pw}@mgmt:15672",
    "'amqp://u:{pw}@rabbit/v'",
    "(url=amqp:///u:{pw}@rabbit)",
]
#: Passwords with the characters that break URL parsers.
PASSWORDS = ["Plain7x", "Sl/ash9", "At@sign8", "Co:lon6", "Pe%rcent5", "Mix/@:%4", "/Lead3"]


#: Every shape with every password, but an '@' in the password of a URL without a host: that
#: '@' makes a host of what follows, a valid URL whose password is what precedes it.
CASES = [
    (shape, password)
    for shape in SHAPES
    for password in PASSWORDS
    if not ("@" in password and "@" not in shape)
]


@pytest.mark.parametrize(("shape", "password"), CASES)
def test_mask_url_hides_the_password_of_every_url_shape(shape: str, password: str) -> None:
    text = "error: " + shape.format(pw=password) + " and more"
    masked = mask_url(text)
    assert password not in masked, masked
    assert "***" in masked
    assert password in url_passwords(text) or any(password in p for p in url_passwords(text))


@pytest.mark.parametrize(
    "shape",
    [
        "amqp://u:{pw}@rabbit:5672/%2F",
        "postgresql+psycopg://u:{pw}@db:5432/x",
        "http://u:{pw}@mgmt:15672",
        "'amqp://u:{pw}@rabbit/v'",
        "cannot connect to RabbitMQ at amqp://edgepw:{pw}@127.0.0.1:1/: refused",
    ],
)
@pytest.mark.parametrize("password", ["Edge Pw666", "two  spaces\tand7"])
def test_a_password_with_white_space_is_masked_whole(shape: str, password: str) -> None:
    text = "error: " + shape.format(pw=password) + " and more"
    masked = mask_url(text)
    pieces = password.split()
    assert not any(piece in masked for piece in pieces), masked
    assert mask_text(text, shape.format(pw=password)).count("***") >= 1
    assert not any(piece in mask_text(pieces[-1], shape.format(pw=password)) for piece in pieces)


@pytest.mark.parametrize(
    "text",
    [
        "amqp://rabbit:5672/%2F",
        "postgresql+psycopg://app@db:5432/orders",
        "http://[::1]:15672/api",
        "(Background on this error at: https://sqlalche.me/e/20/e3q8)",
        "error: no database: pass --db-url",
        "    @click.option('--x')",
        'File "/a/b.py", line 3, in f',
    ],
)
def test_mask_url_leaves_text_without_credentials_alone(text: str) -> None:
    assert mask_url(text) == text
    assert url_passwords(text) == set()


def test_mask_text_hides_a_password_quoted_alone() -> None:
    url = "amqp://u:Alone-secret9"
    assert mask_text("invalid port 'Alone-secret9'", url) == "invalid port '***'"


def _printed(exc: BaseException) -> str:
    return str(exc) + repr(exc) + "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("password", PASSWORDS)
def test_malformed_urls_given_to_the_library_raise_errors_without_the_password(
    password: str,
) -> None:
    hostless = (
        []
        if "@" in password or password.startswith("/")
        else [f"postgresql+psycopg://u:{password}"]
    )
    for db_url in (*hostless, f"postgresql+psycopg:/u:{password}@h"):
        with pytest.raises(ConfigurationError) as raised:
            Service("billing", db_url=db_url)
        assert password not in _printed(raised.value)
    for mq_url in (f"amqp//u:{password}@h/v", f"amqp:/u:{password}@h", f"u:{password}@h"):
        with pytest.raises(ConfigurationError) as raised:
            Service("billing", db_url="sqlite:///x.db", mq_url=mq_url)
        assert password not in _printed(raised.value)
    if "@" not in password and not password.startswith("/"):  # else a valid URL
        with pytest.raises(ConfigurationError) as raised:
            RabbitMQBroker(f"amqp://u:{password}")
        assert password not in _printed(raised.value)
        with pytest.raises(ConfigurationError) as raised:
            ManagementAPI(f"http://u:{password}", "/")
        assert password not in _printed(raised.value)


def test_settings_repr_masks_both_urls() -> None:
    service = Service(
        "billing",
        db_url="postgresql+psycopg://u:Repr-db-pw1@db/x",
        mq_url="amqp://u:Repr/mq@pw2@rabbit/",
    )
    shown = repr(service.settings) + repr(service)
    assert "Repr-db-pw1" not in shown and "Repr/mq@pw2" not in shown


def test_every_library_log_record_is_masked_at_every_level_with_its_traceback() -> None:
    """A remembered password is masked in the records of the library's loggers (and pika's,
    psycopg's, SQLAlchemy's) at every level: message, arguments, traceback and stack, even
    where no URL surrounds it (libpq: 'unexpected spaces found in "<password>"')."""
    import io
    import logging
    from urllib.parse import quote

    from outbox_inbox.logsafe import remember

    password = "Hid den@:/%'\"é7Word"
    remember(f"postgresql+psycopg://u:{quote(password, safe='')}@db/x")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        for name in ("outbox_inbox.waker", "outbox_inbox.cli.run", "psycopg", "sqlalchemy.pool"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
                logger.log(level, "cannot LISTEN: %s", f'unexpected spaces found in "{password}"')
            try:
                raise ValueError(f"bad conninfo password={password}")
            except ValueError:
                logger.exception("failed", stack_info=True)
            logger.setLevel(logging.NOTSET)
    finally:
        root.removeHandler(handler)
    logged = stream.getvalue()
    assert logged.count("***") >= 4 * 5, logged
    assert "Hid den" not in logged and "7Word" not in logged, logged


def test_a_record_with_nothing_to_mask_keeps_its_template_for_filters() -> None:
    # The library's own filters (and a user's) match records by their template: pika's
    # "Received %s from broker" on a connection.blocked frame is logged at DEBUG that way.
    logger = logging.getLogger("pika.connection")
    plain = logger.makeRecord(
        logger.name, logging.WARNING, "f", 1, "Received %s from broker", ("a frame",), None
    )
    assert (plain.msg, plain.args) == ("Received %s from broker", ("a frame",))
    url = "amqp://app:kept-secret-9@rabbit/"
    Service("billing", db_url="sqlite://", mq_url=url)  # the library remembers its password
    secret = logger.makeRecord(
        logger.name, logging.WARNING, "f", 1, "Received %s from broker", ("kept-secret-9",), None
    )
    assert "kept-secret-9" not in secret.getMessage()
