"""Waking a loop on PostgreSQL NOTIFY, with polling as the fallback.

LISTEN needs a database session of its own, which a connection pooler in transaction mode
does not give: so a waker proves its path with a self-NOTIFY probe, and polls when the probe
does not come back. How it checks, when it tries again, and what it logs are in
docs/runbook.md ("Connection poolers"); the waker's contract is in `Waker`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import selectors
import threading
import time
import uuid

import psycopg
from psycopg import pq, sql
from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url

from .database import client_bounds
from .queries import roles

log = logging.getLogger(__name__)

#: How long a probe waits for its own notification, in seconds.
PROBE_TIMEOUT = 2.0
#: How often a waker proves its path again: after this long without a notification while
#: listening, and as the delay before listening again after a failed probe.
PROBE_INTERVAL = 300.0
#: The payload prefix of probe notifications (a loop woken by one only polls once more).
PROBE_PREFIX = "outbox_inbox.probe:"
#: How long taking back a registration that landed on a pooled server connection may take, in
#: seconds (see `release_listen`).
RELEASE_TIMEOUT = 5.0
#: How long one step of `release_listen` waits for the pooler to give it a server connection
#: before it lets go of every one it holds (so that it never waits while holding).
RELEASE_WAIT = 0.5
#: At most this many server connections held at once by `release_listen`.
RELEASE_HOLD = 100


# Paths (masked URL) already warned about: a warning once per process, not per role.
_warned: set[str] = set()
_warned_lock = threading.Lock()
# One `release_listen` at a time per process: two would hold what the other looks for.
_release_lock = threading.Lock()


def notify_channel(schema: str, table: str) -> str:
    """The channel the insert trigger of `schema.table` notifies (see the migrations)."""
    return f"{schema}.{table}"


def helpers_channel(channel: str) -> str:
    """The channel of the wakers of `channel` that do not lead it (`Waker`): ``<channel>.helpers``,
    or a digest of it where that would pass PostgreSQL's 63 bytes (NOTIFY refuses longer)."""
    helpers = f"{channel}.helpers"
    if len(helpers.encode()) <= 63:
        return helpers
    return f"helpers.{hashlib.sha256(channel.encode()).hexdigest()[:40]}"


def psycopg_conninfo(url: URL | str) -> str:
    """A libpq connection string of keywords for a SQLAlchemy URL of the psycopg dialect, read
    as its engines read it, with the `client_bounds` it does not set: any character may stand
    in its password (libpq refuses a raw space in a URL, and quotes it in the error)."""
    parsed = make_url(url) if isinstance(url, str) else url
    _, params = parsed.get_dialect()().create_connect_args(parsed)
    return psycopg.conninfo.make_conninfo("", **params, **client_bounds(parsed))


def _pid(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return int(str(row[0])) if row is not None else 0


def _pid_after(conn: psycopg.Connection[tuple[object, ...]], statement: sql.Composed) -> int | None:
    """Run `statement`, then say which server connection (backend pid) it ran on: one query
    string runs on one server connection, pooled or not. Raises psycopg.Error."""
    cursor = conn.execute(sql.SQL("{}; SELECT pg_backend_pid()").format(statement))
    cursor.nextset()
    row = cursor.fetchone()
    return int(str(row[0])) if row is not None else None


def _where(conninfo: str) -> str:
    """host:port/dbname of a libpq connection string, for log lines (never the password)."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    return f"{params.get('host')}:{params.get('port') or 5432}/{params.get('dbname')}"


class Waker:
    """Waits until a NOTIFY arrives on `channel`, `timeout` passes, or `stop` is set. Owns one
    autocommit connection (`conninfo`) used only for LISTEN; while it is broken the waker polls.
    With `probe` (an engine of the same database) a self-NOTIFY proves the path (docs/runbook.md,
    "Connection poolers"): `listening` is True once one came back, False while polling because one
    did not, None before a verdict; `setting` names what the warning tells the operator to set. With
    `helpers`, one waker of `channel` leads (`leading`) and the others listen on `helpers`
    (docs/runbook.md, "Only one worker listens at a time"). Not thread-safe: one per loop."""

    def __init__(
        self,
        conninfo: str,
        channel: str,
        stop: threading.Event,
        *,
        probe: Engine | None = None,
        setting: str = "listen_url",
        helpers: str | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._channel = channel  # the channel listened on: `_lead`'s, or `_helpers`
        self._lead, self._helpers = channel, helpers
        self.leading = helpers is None
        self._stop, self._probe, self._setting = stop, probe, setting
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._pid: int | None = None
        self.listening: bool | None = None
        self._retry_at = 0.0
        self._heard_at = time.monotonic()
        self._woken = False

    def check(self) -> bool | None:
        """Connect and probe now; the verdict (see `listening`). Keeps the connection."""
        self._connect()
        return self.listening

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self.listening is False and time.monotonic() < self._retry_at:
            return None
        try:
            # Bounded as the engines are (`psycopg_conninfo`): a dead path is a lost LISTEN
            # connection, not a silence.
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            log.warning("cannot LISTEN on %s, polling instead: %s", self._channel, exc)
            return None
        if self._probe is not None and not self._pinned(conn):
            # The pooler gave our server connection to another client: LISTEN would be lost
            # there, and stay registered for that client. Not a word of it is sent.
            self._polling(conn)
            return None
        try:
            if self._helpers is not None:  # lead (a session lock) only on a proven path
                self.leading = self._probe is None and _take_lead(conn, self._lead)
                self._channel = self._lead if self.leading else self._helpers
            # The pid says which server holds the registration, should it have to be taken back.
            self._pid = _pid_after(conn, sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            log.warning("cannot LISTEN on %s, polling instead: %s", self._channel, exc)
            conn.close()
            return None
        self._conn = conn
        if self._probe is not None and not self._proven(conn):
            return None
        if self._helpers is not None and not self.leading:
            self._took_lead(conn)
        self._heard_at = time.monotonic()
        return self._conn

    def _pinned(self, conn: psycopg.Connection[tuple[object, ...]]) -> bool:
        """Whether `conn` keeps its server session while idle (no pooler in transaction mode):
        once another connection (the engine's) is given the server connection `conn` used
        last, as PgBouncer does, `conn`'s next query runs on another. True when no other client
        was given our session in a few tries (the NOTIFY probe then checks). Sets no state."""
        assert self._probe is not None
        try:
            for _ in range(5):
                mine = _pid(conn)
                with self._probe.connect() as other, other.begin():
                    if roles.backend_pid(other) != mine:
                        continue
                    return _pid(conn) == mine
        except Exception as exc:  # the database is away: no verdict yet
            log.debug("wake-up pooler check on %s not done: %s", self._channel, exc)
        return True

    def _proven(self, conn: psycopg.Connection[tuple[object, ...]]) -> bool:
        """Probe the path of `conn`; on failure take the registration back and poll."""
        assert self._probe is not None
        payload = f"{PROBE_PREFIX}{uuid.uuid4()}"
        try:
            with self._probe.begin() as other:
                roles.notify(other, self._channel, payload)
        except Exception as exc:
            # No verdict yet: an unproven registration is not kept (behind a pooler it would
            # stay on a server connection other clients get); the next wait tries again.
            log.debug("wake-up probe on %s not sent: %s", self._channel, exc)
            self._take_back(conn)
            self.close()
            return False
        arrived = False
        try:
            for note in conn.notifies(timeout=PROBE_TIMEOUT):
                if note.payload == payload:
                    arrived = True
                    break
                self._woken = True  # a real notification: the loop has work
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost: %s", exc)
            self.close()
            return False
        if arrived:
            if self.listening is not True:
                log.info("wake-ups on %s arrive through %s", self._channel, _where(self._conninfo))
            self.listening = True
            return True
        self._take_back(conn)
        self._polling(conn)
        return False

    def _polling(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """The path cannot deliver: close `conn`, poll, warn once per process and path."""
        self.listening = False
        self._retry_at = time.monotonic() + PROBE_INTERVAL
        with contextlib.suppress(psycopg.Error):
            conn.close()
        self.close()
        where = _where(self._conninfo)
        with _warned_lock:
            first = where not in _warned
            _warned.add(where)
        if first:
            log.warning(
                "wake-ups do not arrive through %s: a NOTIFY on %s did not reach the LISTEN "
                "connection within %.0f s, as happens behind a connection pooler in transaction "
                "mode (PgBouncer pool_mode=transaction), which gives LISTEN no session. Set %s "
                "to a direct PostgreSQL URL (bypassing the pooler) for wake-ups; until then "
                "every role polls (the *_poll_interval settings) and tries again every %.0f s; "
                "workers hold no liveness lock either (a killed worker's messages wait for "
                "their lease).",
                where,
                self._channel,
                PROBE_TIMEOUT,
                self._setting,
                PROBE_INTERVAL,
            )

    def _take_back(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """UNLISTEN on the server connection that holds the registration (`_pid`), so that no
        other client of a pooler inherits it: through `conn`, or, when that ran on another
        server connection (a pooler in transaction mode), through `release_listen`."""
        pid, self._pid = self._pid, None
        try:
            ran_on = _pid_after(conn, sql.SQL("UNLISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:  # the session, and with it a direct registration, is gone
            log.debug("UNLISTEN %s not sent: %s", self._channel, exc)
            return
        if pid is None or ran_on is None or ran_on == pid:
            return
        release_listen(self._conninfo, self._channel, pid, probe=self._probe)

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if a notification arrived."""
        if self._stop.is_set():
            return False
        conn = self._connect()
        if conn is None:
            self._stop.wait(timeout)
            return False
        if self._woken:
            self._woken = False
            return True
        if self._probe is not None and time.monotonic() - self._heard_at > PROBE_INTERVAL:
            if not self._proven(conn):
                self._stop.wait(timeout)
                return False
            self._heard_at = time.monotonic()
        remaining = timeout
        try:
            # Wait in slices so that a stop request is seen within a fraction of a second.
            while remaining > 0 and not self._stop.is_set():
                if not self.leading and self._took_lead(conn):
                    return True  # what came while this loop listened elsewhere: claim once
                slice_ = min(remaining, 0.25)
                # An open notifies() generator holds the connection's lock: close it before
                # draining what else is queued, so that one burst wakes the loop once.
                with contextlib.closing(conn.notifies(timeout=slice_, stop_after=1)) as stream:
                    arrived = next(stream, None) is not None
                if arrived:
                    # What is already here, without waiting: psycopg spends the last
                    # millisecond before a timeout polling, a millisecond of CPU per wake-up.
                    for _ in conn.notifies(timeout=0):
                        pass
                    self._heard_at = time.monotonic()
                    return True
                remaining -= slice_
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost: %s", exc)
            self.close()
        return False

    def _took_lead(self, conn: psycopg.Connection[tuple[object, ...]]) -> bool:
        """Take the lead if its holder is gone (its session ended): listen on the lead's channel
        from now on. False when another waker leads, or on an error (the next wait retries)."""
        try:
            if not _take_lead(conn, self._lead):
                return False
            conn.execute(
                sql.SQL("UNLISTEN {}; LISTEN {}").format(
                    sql.Identifier(self._channel), sql.Identifier(self._lead)
                )
            )
        except psycopg.Error as exc:
            log.debug("taking the lead of %s failed: %s", self._lead, exc)
            return False
        self._channel, self.leading = self._lead, True
        return True

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None


def _take_lead(conn: psycopg.Connection[tuple[object, ...]], channel: str) -> bool:
    """Whether this session holds, or now takes, the lead of `channel` (a session lock)."""
    row = conn.execute(
        "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (roles.LEAD_LOCK, channel)
    ).fetchone()
    return bool(row and row[0])


def release_listen(conninfo: str, channel: str, pid: int, *, probe: Engine | None = None) -> bool:
    """UNLISTEN `channel` on the server connection of backend `pid`, behind the pooler at `conninfo`
    (transaction mode); True once done or once that backend is gone (`probe`, an engine of the same
    database, tells), else a warning and False. The pooler picks the server connection of each
    transaction, so `pid`'s is reached by holding a transaction on each other one it hands out; a
    step given none within `RELEASE_WAIT` lets go of all, so it never waits while holding.
    `RELEASE_HOLD` and `RELEASE_TIMEOUT` bound it."""
    query = (
        sql.SQL("BEGIN; UNLISTEN {}; SELECT pg_backend_pid()")
        .format(sql.Identifier(channel))
        .as_string(None)
        .encode()
    )
    target = psycopg.conninfo.make_conninfo(conninfo, connect_timeout=5)
    deadline = time.monotonic() + RELEASE_TIMEOUT
    held: list[pq.abc.PGconn] = []
    with _release_lock:
        try:
            while time.monotonic() < deadline:
                if not held and probe is not None and not _backend_exists(probe, pid):
                    return True
                step = pq.PGconn.connect(target.encode())
                held.append(step)
                if step.status != pq.ConnStatus.OK:
                    raise psycopg.OperationalError(step.get_error_message())
                given = _run_within(step, query, RELEASE_WAIT)
                if given == pid:
                    # Unanswered, the COMMIT still ends it: PgBouncer drops a server connection
                    # whose client left in a transaction.
                    _run_within(step, b"COMMIT", RELEASE_WAIT)
                    held.remove(step)
                    step.finish()
                    return True
                if given is None or len(held) >= RELEASE_HOLD:
                    _let_go(held)
                    time.sleep(random.uniform(0.01, 0.1))
        except (psycopg.Error, OSError) as exc:
            log.warning("could not take LISTEN %s back from backend %d: %s", channel, pid, exc)
            return False
        finally:
            _let_go(held)
    log.warning(
        "could not take LISTEN %s back from backend %d within %.0f s: the pooler did not hand "
        "out its server connection; the pooler's server_lifetime ends it",
        channel,
        pid,
        RELEASE_TIMEOUT,
    )
    return False


def _backend_exists(engine: Engine, pid: int) -> bool:
    try:
        with engine.begin() as conn:
            return roles.backend_exists(conn, pid)
    except Exception as exc:  # no verdict: go on looking
        log.debug("backend %d not looked up: %s", pid, exc)
        return True


def _run_within(conn: pq.abc.PGconn, query: bytes, timeout: float) -> int | None:
    """Send `query` on `conn`; the first value of its last row (a backend pid), or None when
    no answer came within `timeout` seconds. Raises psycopg.Error on an error result."""
    conn.send_query(query)
    end = time.monotonic() + timeout
    value: int | None = None
    with selectors.DefaultSelector() as selector:
        selector.register(conn.socket, selectors.EVENT_READ)
        while True:
            while conn.is_busy():
                left = end - time.monotonic()
                if left <= 0:
                    return None
                if selector.select(left):
                    conn.consume_input()
            result = conn.get_result()
            if result is None:
                return value
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.OperationalError(result.get_error_message())
            if result.status == pq.ExecStatus.TUPLES_OK and result.ntuples:
                cell = result.get_value(0, 0)
                value = int(cell) if cell is not None else None


def _let_go(held: list[pq.abc.PGconn]) -> None:
    """Roll back and close each held transaction (closing alone would make PgBouncer drop
    the server connection it was given), and empty `held`."""
    for conn in held:
        with contextlib.suppress(psycopg.Error):
            _run_within(conn, b"ROLLBACK", RELEASE_WAIT)
        conn.finish()
    held.clear()
