"""A private PgBouncer on loopback, in front of the tests' PostgreSQL (Debian's pgbouncer).

One `PgBouncerServer` per pool mode: its ``[databases]`` section is the fallback entry ``*``,
so every database of the PostgreSQL server is reachable through it under its own name, and
``url(db_url)`` turns a direct test URL into the same database through the pooler.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from outbox_inbox.testing.servers import (
    LOCALHOST,
    ServerError,
    _is_root,
    _LocalServer,
    _Process,
    _tail,
    free_port,
)
from servers import PGBOUNCER_BIN

#: The user PgBouncer runs as when we are root (it refuses to run as root).
RUN_AS = "postgres"


class PgBouncerServer(_LocalServer):
    """PgBouncer in `pool_mode` ('session' or 'transaction') in front of `server_url`'s server.

    `pool_size` server connections per database and user (``default_pool_size``); clients
    beyond them wait. ``start()``, ``url(db_url)``, ``admin(command)``, ``cleanup()``.
    """

    def __init__(self, server_url: str, pool_mode: str, *, pool_size: int = 8) -> None:
        if pool_mode not in ("session", "transaction"):
            raise ValueError(f"pool_mode {pool_mode!r}")
        self.server = make_url(server_url)
        self.pool_mode = pool_mode
        self._kind = f"PgBouncer ({pool_mode} pooling)"
        self.pool_size = pool_size
        self.port = free_port()

    def _config(self, temp_dir: Path) -> str:
        s = self.server
        target = f"host={s.host} port={s.port or 5432} user={s.username}"
        if s.password:
            target += f" password={s.password}"
        return "\n".join(
            [
                "[databases]",
                f"* = {target}",
                "[pgbouncer]",
                f"listen_addr = {LOCALHOST}",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                # Clients are not checked: the server login is the one of the `*` entry.
                "auth_type = any",
                f"pool_mode = {self.pool_mode}",
                f"default_pool_size = {self.pool_size}",
                "max_client_conn = 500",
                f"admin_users = {s.username}",
                # After a failed server login (a database that does not exist), PgBouncer holds
                # the next client of that database this long before it answers with the same
                # error (default 15 s): the same error, sooner.
                "server_login_retry = 1",
                f"logfile = {temp_dir / 'pgbouncer.log'}",
                f"pidfile = {temp_dir / 'pgbouncer.pid'}",
                "",
            ]
        )

    def start(self) -> None:
        """Write the configuration, start PgBouncer and wait until it answers."""
        if not PGBOUNCER_BIN.exists():
            raise ServerError(
                f"{PGBOUNCER_BIN} not found: install Debian's pgbouncer "
                "(python tests/servers.py install-pgbouncer)"
            )
        super().start()

    def _make_temp_dir(self) -> Path:
        temp_dir = Path(tempfile.mkdtemp(prefix="oi-pgbouncer-", dir="/tmp"))
        if _is_root():
            shutil.chown(temp_dir, RUN_AS, RUN_AS)
        return temp_dir

    def _launch(self) -> _Process:
        temp_dir = self._require_temp_dir()
        config = temp_dir / "pgbouncer.ini"
        config.write_text(self._config(temp_dir))
        args = [str(PGBOUNCER_BIN), str(config)]
        if _is_root():
            shutil.chown(config, RUN_AS, RUN_AS)
            args = ["runuser", "-u", RUN_AS, "--", *args]
        return _Process(args, log_path=temp_dir / "output.log", cwd=temp_dir)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            try:
                self.admin("SHOW VERSION")
                return
            except psycopg.Error as exc:
                if not self.running or time.monotonic() > deadline:
                    output = self._require_temp_dir() / "output.log"
                    raise ServerError(f"PgBouncer did not start ({exc}):\n{_tail(output)}") from exc
                time.sleep(0.05)

    def url(self, db_url: str) -> str:
        """`db_url` (a database of the server behind) through this PgBouncer."""
        return make_url(db_url).set(host=LOCALHOST, port=self.port).render_as_string(False)

    def admin(self, command: str) -> list[tuple[object, ...]]:
        """Run a command on PgBouncer's admin console (``SHOW POOLS``, ``RECONNECT``...)."""
        conninfo = psycopg.conninfo.make_conninfo(
            host=LOCALHOST, port=self.port, user=self.server.username, dbname="pgbouncer"
        )
        # The admin console speaks the simple query protocol only.
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            cursor = psycopg.ClientCursor(conn)
            cursor.execute(command)
            return list(cursor.fetchall()) if cursor.description else []

    def stop(self, timeout: float = 10.0) -> None:
        """Kill PgBouncer (SIGKILL to its process group): it keeps nothing a clean shutdown
        would save. A SIGINT sent to it through runuser never stopped it, so every stop waited
        the full 10 s before the kill; with the session's two, that was 20 s of every run."""
        self._kill_processes()

    def _kill_processes(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc = None
