"""No password is ever printed, logged or carried by an exception (docs/security.md, Secrets).

Every command of the real CLI runs in a subprocess with URLs that hold a password of its own:
valid URLs the servers refuse (a wrong password), and malformed URLs of several shapes; from
options, from the environment and from the app's own settings; with and without ``-v`` and
``-vv``; passwords holding "/", "@", ":" and "%". Neither stdout nor stderr may hold the
password or a piece of it. Then a service runs against wrong passwords with every logger at
DEBUG: no log record and no exception (str, repr, traceback with its causes) holds it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from outbox_inbox import OutboxInboxError, Service
from servers import PostgresServer

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "cli.main"]
DB, MQ, MGMT = "db", "mq", "mgmt"

APP = """
import os
from outbox_inbox import Service


def make():
    service = Service(
        "billing",
        db_url=os.environ.get("SECRETS_APP_DB_URL"),
        mq_url=os.environ.get("SECRETS_APP_MQ_URL"),
        fail_fast=True,
    )

    @service.on_event("orders.order.*")
    def on_order(message, session):
        pass

    return service
"""


@dataclass(frozen=True)
class Password:
    """A password made of two unique words around a character URL parsers trip on."""

    head: str
    special: str
    tail: str

    @property
    def text(self) -> str:
        return f"{self.head}{self.special}{self.tail}"

    def leaked_in(self, output: str) -> bool:
        return self.head in output or self.tail in output


_counter = itertools.count()


def new_password(specials: str = "/@:%") -> Password:
    n = next(_counter)
    word = uuid.uuid4().hex
    return Password(f"Sec{n}a{word[:8]}", specials[n % len(specials)], f"Ret{n}b{word[8:16]}")


@dataclass(frozen=True)
class Servers:
    pg_host: str
    pg_port: int
    pg_user: str  # a role that logs in with a password
    mq_host: str
    mq_port: int
    mgmt_port: int | None
    mq_url: str  # a URL RabbitMQ accepts


@pytest.fixture(scope="module")
def servers(postgres_server: Any, rabbitmq_server: Any) -> Iterator[Servers]:
    """The servers, with a PostgreSQL role that must give a password (the local server trusts
    every other login): a wrong password is then refused, as in production."""
    if not isinstance(postgres_server, PostgresServer):
        pytest.skip("needs the local PostgreSQL server, whose pg_hba.conf it edits")
    role = f"secrets_{uuid.uuid4().hex[:8]}"
    hba = postgres_server.data_dir / "pg_hba.conf"
    original = hba.read_text()
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'the-right-one'")
        hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n{original}")
        conn.execute("SELECT pg_reload_conf()")
    mq = urlsplit(rabbitmq_server.url)
    management = getattr(rabbitmq_server, "management_port", None)
    try:
        yield Servers(
            postgres_server.host,
            postgres_server.port,
            role,
            mq.hostname or "127.0.0.1",
            mq.port or 5672,
            management,
            rabbitmq_server.url,
        )
    finally:
        hba.write_text(original)
        with postgres_server.connect() as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(f"DROP ROLE {role}")


# --- the URLs of each case ----------------------------------------------------------------

#: How each case writes a URL of each kind around a password; and what its error says.
Shape = Callable[[Servers, str], dict[str, str]]


def _wrong_password(s: Servers, pw: str) -> dict[str, str]:
    """Valid URLs: the characters a parser cannot take raw there are percent-encoded (an "@"
    in a database URL, a "/" in the others; the case "raw" writes them raw)."""
    db_pw, pw = pw.replace("@", "%40"), pw.replace("/", "%2F")
    return {
        DB: f"postgresql+psycopg://{s.pg_user}:{db_pw}@{s.pg_host}:{s.pg_port}/postgres",
        MQ: f"amqp://guest:{pw}@{s.mq_host}:{s.mq_port}/%2F",
        MGMT: f"http://guest:{pw}@{s.mq_host}:{s.mgmt_port or 1}",
    }


CASES: dict[str, tuple[Shape, str, str]] = {
    # name: (URLs, the characters its passwords may hold, what the error must say)
    "wrong password": (
        _wrong_password,
        "/@:% ",  # a space too: a raw space in a URL is masked whole
        # A raw "@" is refused in a database URL: SQLAlchemy would read a host from it.
        "password authentication failed|refused the login|ACCESS_REFUSED|HTTP 401",
    ),
    # What the servers would refuse, but with the characters the parsers cannot take raw.
    "raw": (
        lambda s, pw: {
            DB: f"postgresql+psycopg://u:{pw.replace('/', '@')}@{s.pg_host}:{s.pg_port}/x",
            MQ: f"amqp://u:{pw}@{s.mq_host}:{s.mq_port}/x",
            MGMT: f"http://u:{pw}@{s.mq_host}:1",
        },
        "/",
        "malformed|invalid",
    ),
    "missing colon": (
        lambda s, pw: {
            DB: f"postgresql+psycopg//u:{pw}@{s.pg_host}:{s.pg_port}/x",
            MQ: f"amqp//u:{pw}@{s.mq_host}:{s.mq_port}/x",
            MGMT: f"http//u:{pw}@{s.mq_host}:1",
        },
        "/@:%",
        "malformed|invalid",
    ),
    "single slash": (
        lambda s, pw: {
            DB: f"postgresql+psycopg:/u:{pw}@{s.pg_host}/x",
            MQ: f"amqp:/u:{pw}@{s.mq_host}/x",
            MGMT: f"http:/u:{pw}@{s.mq_host}:1",
        },
        "/@:%",
        "malformed|invalid",
    ),
    # No host: the password stands where the port goes. An "@" would make a host of it.
    "no host": (
        lambda s, pw: {
            DB: f"postgresql+psycopg://u:{pw}",
            MQ: f"amqp://u:{pw}",
            MGMT: f"http://u:{pw}",
        },
        "/:%",
        "malformed|invalid",
    ),
    "no scheme": (
        lambda s, pw: {DB: f"u:{pw}@{s.pg_host}/x", MQ: f"u:{pw}@{s.mq_host}/x", MGMT: f"u:{pw}@h"},
        "/@:%",
        "malformed|invalid",
    ),
}


# --- the commands -------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    args: tuple[str, ...]
    uses: frozenset[str]  # which URLs it takes: DB, MQ, MGMT
    app: bool = False  # takes --app (the app's own URLs hold the passwords too)
    good: frozenset[str] = frozenset()  # URLs of these kinds are the servers' right ones
    timeout: float = 60.0  # a server that keeps running (dashboard) is stopped after this


APP_SPEC = ("--app", "secrets_app:make")
ID = "2b4c2f55-3f5e-4bfc-9a41-6f0d5a0e4a11"


def commands(tmp: Path) -> list[Command]:
    both = frozenset({DB, MQ})
    return [
        Command(("db", "upgrade"), frozenset({DB})),
        Command(("db", "downgrade", "base"), frozenset({DB})),
        Command(("db", "current"), frozenset({DB})),
        Command(("db", "upgrade", *APP_SPEC), frozenset(), app=True),
        Command(("status", "--service", "billing"), both),
        Command(("status", *APP_SPEC), frozenset(), app=True),
        Command(("dead-letters", "list", "--service", "billing", "--source", "all"), both),
        Command(("dead-letters", "show", "--service", "billing", "--source", "all", ID), both),
        Command(
            ("dead-letters", "replay", "--service", "billing", "--source", "all", "--all"), both
        ),
        Command(
            ("dead-letters", "purge", "--service", "billing", "--source", "all", "--all", "-y"),
            both,
        ),
        Command(("dead-letters", "list", *APP_SPEC), frozenset(), app=True),
        Command(("tail", "--count", "1", "orders.#"), frozenset({MQ})),
        Command(("topology", "plan", *APP_SPEC), frozenset({MQ, MGMT}), app=True),
        Command(("topology", "apply", *APP_SPEC), frozenset({MQ, MGMT}), app=True),
        Command(("topology", "verify", *APP_SPEC), frozenset({MQ, MGMT}), app=True),
        # The management API's own URL, next to a broker that lets the command in.
        Command(
            ("topology", "plan", *APP_SPEC), frozenset({MQ, MGMT}), app=True, good=frozenset({MQ})
        ),
        Command(("run", "relay", *APP_SPEC, "--fail-fast"), both, app=True),
        Command(("run", "receiver", *APP_SPEC, "--fail-fast"), both, app=True),
        Command(("run", "worker", *APP_SPEC, "--fail-fast"), both, app=True),
        Command(("run", "all", *APP_SPEC), both, app=True),
        Command(
            ("archive", "--service", "billing", "--to", str(tmp / "archive"), "--dry-run"),
            frozenset({DB}),
        ),
        Command(("demo", "--timeout", "5"), both),
        Command(
            ("dashboard", "--service", "billing", "--port", "0", "--refresh", "0"),
            both,
            timeout=8.0,
        ),
    ]


_OPTION = {DB: "--db-url", MQ: "--mq-url", MGMT: "--management-url"}
_ENV = {
    DB: "OUTBOX_INBOX_DB_URL",
    MQ: "OUTBOX_INBOX_MQ_URL",
    MGMT: "OUTBOX_INBOX_MANAGEMENT_URL",
}


@dataclass
class Run:
    argv: list[str]
    password: Password
    output: str
    returncode: int | None


def run_cli(
    command: Command,
    urls: dict[str, str],
    *,
    verbose: int,
    from_env: bool,
    app_dir: Path,
    password: Password,
    good: dict[str, str] | None = None,
) -> Run:
    urls = {**urls, **{kind: (good or {})[kind] for kind in command.good}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(app_dir)])
    env["OUTBOX_INBOX_DASHBOARD_TOKEN"] = "a-token-of-at-least-16-characters"
    argv = [*CLI, *(["-" + "v" * verbose] if verbose else []), *command.args]
    if command.app:
        env["SECRETS_APP_DB_URL"] = urls[DB]
        env["SECRETS_APP_MQ_URL"] = urls[MQ]
    for kind in sorted(command.uses):
        if from_env:
            env[_ENV[kind]] = urls[kind]
        else:
            argv += [_OPTION[kind], urls[kind]]
    try:
        done = subprocess.run(
            argv,
            cwd=app_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=command.timeout,
            check=False,
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:  # a server that runs: what it printed so far
        output = _text(stopped.stdout) + _text(stopped.stderr)
        code = None
    return Run(argv[len(CLI) :], password, output, code)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("secrets_app")
    (directory / "secrets_app.py").write_text(APP)
    return directory


def _job(command: Command, case: str, n: int, servers: Servers) -> dict[str, Any]:
    shape, specials, _expected = CASES[case]
    password = new_password(specials)
    return {
        "command": command,
        "case": case,
        "urls": shape(servers, password.text),
        "verbose": n % 3,  # none, -v (tracebacks), -vv (debug logs)
        "from_env": n % 2 == 1,
        "password": password,
        "good": {MQ: servers.mq_url},
    }


def _run_all(jobs: list[dict[str, Any]], app_dir: Path) -> None:
    """Run the jobs, four at a time; fail on any password printed, or a bad URL not reported."""

    def one(job: dict[str, Any]) -> tuple[str, Run]:
        values = {k: v for k, v in job.items() if k != "case"}
        return job["case"], run_cli(app_dir=app_dir, **values)

    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(one, jobs))
    leaks = [f"{' '.join(r.argv)}\n{r.output}" for _, r in runs if r.password.leaked_in(r.output)]
    assert not leaks, "password printed by:\n" + "\n\n".join(leaks)
    # Each command met the bad URL and said so, rather than stopping before it.
    unexplained = [
        f"[{case}] {' '.join(r.argv)} -> {r.returncode}\n{r.output[-600:]}"
        for case, r in runs
        if r.returncode is not None and not re.search(CASES[case][2], r.output)
    ]
    assert not unexplained, "did not report the bad URL:\n" + "\n\n".join(unexplained)


def test_no_command_prints_a_password_the_servers_refused(servers: Servers, app_dir: Path) -> None:
    jobs = [
        _job(command, "wrong password", n, servers) for n, command in enumerate(commands(app_dir))
    ]
    _run_all(jobs, app_dir)


def test_no_command_prints_the_password_of_a_malformed_url(servers: Servers, app_dir: Path) -> None:
    shapes = [case for case in CASES if case != "wrong password"]
    # Every command with one shape (in turn), and every shape with the URL of each kind
    # given by option, by environment variable and in the app.
    jobs = [
        _job(command, shapes[n % len(shapes)], n, servers)
        for n, command in enumerate(commands(app_dir))
    ]
    every_kind = [
        Command(("db", "current"), frozenset({DB})),
        Command(("tail", "--count", "1", "orders.#"), frozenset({MQ})),
        Command(
            ("topology", "plan", *APP_SPEC), frozenset({MQ, MGMT}), app=True, good=frozenset({MQ})
        ),
        Command(("status", *APP_SPEC), frozenset(), app=True),
    ]
    n = len(jobs)
    for shape in shapes:
        for command in every_kind:
            jobs.append(_job(command, shape, n, servers))
            n += 1
    _run_all(jobs, app_dir)


def test_a_url_typed_as_an_argument_is_masked_in_usage_errors(app_dir: Path) -> None:
    password = new_password()
    url = f"postgresql+psycopg://u:{password.text}@db/x"
    for args in (("db", "current", url), (url,)):
        run = run_cli(
            Command(args, frozenset()),
            {},
            verbose=0,
            from_env=False,
            app_dir=app_dir,
            password=password,
        )
        assert run.returncode == 2, run.output
        assert not password.leaked_in(run.output), run.output
        assert "***" in run.output


# --- the library, in this process ---------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = logging.Formatter("%(name)s %(levelname)s %(message)s").format(record)
        with self._lock:
            self.lines.append(line)


@pytest.fixture
def every_log_record() -> Iterator[_Records]:
    """Every log record of every logger at DEBUG, formatted with its traceback."""
    records = _Records()
    root = logging.getLogger()
    previous = (
        root.level,
        {name: logging.getLogger(name).level for name in logging.root.manager.loggerDict},
    )
    root.addHandler(records)
    root.setLevel(logging.DEBUG)
    for name in previous[1]:
        logging.getLogger(name).setLevel(logging.NOTSET)
    try:
        yield records
    finally:
        root.removeHandler(records)
        root.setLevel(previous[0])
        for name, level in previous[1].items():
            logging.getLogger(name).setLevel(level)


def _printed(exc: BaseException) -> str:
    return str(exc) + repr(exc) + "".join(traceback.format_exception(exc))


def test_a_service_on_wrong_passwords_logs_and_raises_no_password(
    servers: Servers, db_url: str, mq_url: str, every_log_record: _Records
) -> None:
    raised: list[BaseException] = []
    passwords: list[Password] = []

    def attempt(make: Callable[[], Service], *, run: str) -> None:
        service = make()
        try:
            if run == "start":
                service.start(fail_fast=True)
            else:  # a role that retries on its own: let it fail for a while
                stop = threading.Timer(2.0, service._stop.set)
                stop.start()
                getattr(service, run)()
                stop.cancel()
        except Exception as exc:
            raised.append(exc)
        finally:
            service.close()

    # A wrong RabbitMQ password, with a database that works: start, and the relay alone.
    for run in ("start", "run_relay"):
        pw = new_password()
        passwords.append(pw)
        wrong_mq = _wrong_password(servers, pw.text)[MQ]
        attempt(functools.partial(_service, db_url, wrong_mq, migrate=True), run=run)
    # A wrong PostgreSQL password, with a broker that works.
    for run in ("start", "run_worker"):
        pw = new_password()
        passwords.append(pw)
        wrong_db = _wrong_password(servers, pw.text)[DB]
        attempt(functools.partial(_service, wrong_db, mq_url, migrate=False), run=run)
    # Malformed URLs: the constructor refuses them.
    for shape, specials, _expected in list(CASES.values())[1:]:
        pw = new_password(specials)
        passwords.append(pw)
        urls = shape(servers, pw.text)
        for db, mq_ in ((urls[DB], mq_url), (db_url, urls[MQ])):
            try:  # the constructor checks the URLs; the broker parses its own at first use
                Service("billing", db_url=db, mq_url=mq_).broker  # noqa: B018
            except OutboxInboxError as exc:
                raised.append(exc)
            else:
                pytest.fail(f"no error for {db} / {mq_}")
    pw = new_password()
    passwords.append(pw)
    settings = Service("billing", db_url=db_url, mq_url=f"amqp://g:{pw.text}@h/").settings
    shown = repr(settings) + str(settings)

    assert len(raised) >= 10, raised
    assert any("refused the login" in str(e) for e in raised), raised
    assert any("password authentication failed" in str(e) for e in raised), raised
    logged = "\n".join(every_log_record.lines)
    assert logged, "no log record at all: the capture is broken"
    printed = "\n".join(_printed(e) for e in raised) + shown
    for password in passwords:
        assert not password.leaked_in(logged), f"{password.text} logged:\n{logged}"
        assert not password.leaked_in(printed), f"{password.text} raised:\n{printed}"


def _service(db_url: str, mq_url: str, *, migrate: bool) -> Service:
    service = Service(
        "billing",
        db_url=db_url,
        mq_url=mq_url,
        reconnect_initial=0.1,
        reconnect_max=0.5,
        relay_poll_interval=0.2,
    )
    if migrate:  # a database the service can use, so that it gets as far as the broker
        service.migrate()
    return service


# --- a right password with every character a URL parser trips on ----------------------------

#: A space, "@", ":", "/", "%", both quotes and a non-ASCII letter, all in one password.
SPECIALS = " @:/%'\"é"


@pytest.fixture
def special_db_url(
    servers: Servers, postgres_server: Any, db_url: str
) -> tuple[str, Password, Servers]:
    """`db_url`'s database, now owned by the password role of `servers`, whose password holds
    every character of SPECIALS; its URL (percent-encoded, as it must be) and the password."""
    from psycopg import sql
    from sqlalchemy.engine import make_url

    words = new_password()
    password = Password(words.head, SPECIALS, words.tail)
    database = make_url(db_url).database
    with postgres_server.connect() as conn:
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(servers.pg_user), sql.Literal(password.text)
            )
        )
        conn.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
                sql.Identifier(database), sql.Identifier(servers.pg_user)
            )
        )
    encoded = quote(password.text, safe="")
    url = f"postgresql+psycopg://{servers.pg_user}:{encoded}@{servers.pg_host}:{servers.pg_port}"
    return f"{url}/{database}", password, servers


def test_a_password_with_any_character_listens_and_no_role_logs_it(
    special_db_url: tuple[str, Password, Servers], mq_url: str, every_log_record: _Records
) -> None:
    """The waker connects with it (LISTEN works: no role polls for want of it), and no record of
    any role at any level holds it (the waker logged libpq's "unexpected spaces found in
    '<password>'" three times a second)."""
    from helpers import FAST, wait_until

    url, password, _ = special_db_url
    service = Service("billing", db_url=url, mq_url=mq_url, **FAST)
    service.migrate()
    handled: list[object] = []
    service.on_command("invoice.create")(lambda message, session: handled.append(message))
    try:
        service.start()
        assert service.wakeups() is True
        with service.engine.begin() as conn:
            service.outbox.send(conn, "billing", "invoice.create", {"n": 1})
        wait_until(lambda: handled, what="the command handled")
    finally:
        service.stop()
        service.close()
    logged = "\n".join(every_log_record.lines)
    assert "cannot LISTEN" not in logged, logged
    assert "arrive through" in logged, logged  # the roles' waker listens
    assert not password.leaked_in(logged), logged


def test_the_cli_with_such_a_password_listens_and_prints_it_nowhere(
    special_db_url: tuple[str, Password, Servers], mq_url: str, app_dir: Path
) -> None:
    """`run all` at -vv (every role's log at DEBUG), `status`, `db current`, and an error with
    its -vv traceback (a database without the tables), the URL from the app and by option."""
    url, password, servers = special_db_url
    urls = {DB: url, MQ: mq_url, MGMT: f"http://{servers.mq_host}:{servers.mgmt_port or 1}"}
    both = frozenset({DB, MQ})
    runs = [
        run_cli(
            Command(c, uses, app=app),
            urls,
            verbose=v,
            from_env=env,
            app_dir=app_dir,
            password=password,
        )
        for c, uses, app, v, env in [
            (("status", "--service", "billing"), both, False, 2, False),  # no tables yet
            (("db", "upgrade"), frozenset({DB}), False, 2, True),
            (("db", "current"), frozenset({DB}), False, 1, False),
            (("status", *APP_SPEC), frozenset(), True, 2, False),
        ]
    ]
    runs.append(
        run_cli(
            Command(("run", "all", *APP_SPEC), frozenset(), app=True, timeout=12.0),
            urls,
            verbose=2,
            from_env=False,
            app_dir=app_dir,
            password=password,
        )
    )
    for run in runs:
        assert not password.leaked_in(run.output), f"{run.argv}\n{run.output}"
        assert "cannot LISTEN" not in run.output, f"{run.argv}\n{run.output}"
    assert runs[0].returncode == 1 and "Traceback" in runs[0].output, runs[0].output
    # status: exit 4, the inbox queue is not declared yet (no receiver ran)
    assert [r.returncode for r in runs[1:4]] == [0, 0, 4], [r.output for r in runs]
    assert runs[4].returncode is None, runs[4].output  # ran until stopped
    assert "arrive through" in runs[4].output, runs[4].output  # the roles listen
