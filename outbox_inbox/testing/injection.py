"""Faults to inject into private servers, each undone in a ``finally`` however the block ends. The
fault kit (`outbox_inbox.testing.faultkit`) injects them by name; the library's own fault tests call
them directly: a crash of PostgreSQL, a failover to a streaming replica, sessions terminated, a full
disk, RabbitMQ's resource alarms, and a port blackholed by iptables."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg import sql

from .servers import PostgresHandle, PostgresServer, RabbitMQServer, _run, wait_until

#: What RabbitMQ's memory high watermark is set back to (the node's default).
DEFAULT_WATERMARK = "0.4"
#: A watermark far below what any node uses: the memory alarm goes off at once.
ALARM_WATERMARK = "0.0000001"
#: A disk free limit far above the free space of any disk (1 PB): the disk alarm goes off.
ALARM_DISK_LIMIT = str(10**15)


def stop_postgres_immediately(server: PostgresServer) -> None:
    """``pg_ctl stop -m immediate`` on the local server, then let `server` reap its process;
    `server.start()` brings it back (crash recovery, same data directory and port)."""
    _pg_ctl(server, "stop", "-m", "immediate")
    wait_until(lambda: not server.running, timeout=10, what="the postmaster to exit")
    server.stop()  # nothing left to stop: reaps the exited process and forgets it


def _pg_ctl(server: PostgresServer, *args: str) -> None:
    """``pg_ctl ARGS -w -t 30 -D <data>`` as the cluster's owner; ServerError if it fails."""
    command = [str(server.bin_dir / "pg_ctl"), *args, "-w", "-t", "30", "-D", str(server.data_dir)]
    _run(server._as_postgres(command), f"pg_ctl {' '.join(args)}", cwd=server.socket_dir)


class StreamingReplica(PostgresServer):
    """A hot standby of `primary` (a running local server), on a port and directory of its own:
    its first `start()` copies the primary (``pg_basebackup -R``), then it streams the primary's
    WAL as ``cluster_name`` `name` (what ``synchronous_standby_names`` names). `promote()` fails
    over to it; `cleanup()` removes it like any PostgresServer."""

    def __init__(self, primary: PostgresServer, name: str = "replica") -> None:
        # Reconnect to a primary back from a restart in 0.2 s, not 5: commits wait for it.
        settings = {"cluster_name": f"'{name}'", "wal_retrieve_retry_interval": "'200ms'"}
        super().__init__(bin_dir=primary.bin_dir, settings=settings)
        self.primary = primary
        self.name = name

    def _initdb(self) -> None:  # the copy stands for initdb: `_launch` runs it on first start
        backup = [
            str(self.bin_dir / "pg_basebackup"),
            *("-h", self.primary.host, "-p", str(self.primary.port), "-U", self.user),
            *("-D", str(self.data_dir), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync"),
        ]
        _run(self._as_postgres(backup), "pg_basebackup", cwd=self.temp_dir, timeout=120)
        self._write_settings()  # appended: later lines win

    def streaming(self, state: str = "streaming") -> bool:
        """True when the primary reports this standby's walsender in `state` (``sync_state``
        "sync" also counts for "sync")."""
        with self.primary.connect() as conn:
            row = conn.execute(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                [self.name],
            ).fetchone()
        return row is not None and state in row

    def promote(self) -> None:
        """``pg_ctl promote -w``: returns once the standby has become a primary."""
        _pg_ctl(self, "promote")


def terminate_backends(server: PostgresHandle, databases: Sequence[str]) -> list[Any]:
    """``pg_terminate_backend`` every session connected to one of `databases` (never the
    maintenance database it runs on); one row (pid, database, state, terminated) a session."""
    with server.connect() as conn:
        return list(
            conn.execute(
                "SELECT pid, datname, state, pg_terminate_backend(pid)"
                " FROM pg_stat_activity"
                " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
                [list(databases)],
            )
        )


class MountRefused(Exception):
    """A tmpfs cannot be mounted here (not root, or no right to mount in this container)."""


@dataclass
class SmallDisk:
    """A tmpfs of a few MB made a tablespace of a local server (`tablespace_on_tmpfs`)."""

    server: PostgresServer
    path: Path
    tablespace: str
    #: The databases that hold something there: dropped with the tablespace.
    databases: list[str]

    def take_databases(self, names: Sequence[str]) -> None:
        """Move databases, new and unused (``ALTER DATABASE ... SET TABLESPACE`` wants no
        session on them), here: everything they hold, but the WAL, which stays in the
        server's data directory (so a full tmpfs fails statements, never the server)."""
        with self.server.connect() as conn:
            for name in names:
                self.databases.append(name)
                move = sql.SQL("ALTER DATABASE {} SET TABLESPACE {}")
                conn.execute(move.format(sql.Identifier(name), sql.Identifier(self.tablespace)))

    def take_table(self, database: str, table: str) -> None:
        """Move one table of `database` here (``ALTER TABLE ... SET TABLESPACE``)."""
        self.databases.append(database)
        with self.server.connect(database) as conn:
            move = sql.SQL("ALTER TABLE {} SET TABLESPACE {}")
            conn.execute(move.format(sql.Identifier(table), sql.Identifier(self.tablespace)))


@contextlib.contextmanager
def tablespace_on_tmpfs(server: PostgresServer, size_mb: int) -> Iterator[SmallDisk]:
    """A tablespace on a tmpfs of `size_mb` MB of its own for the block (`MountRefused`, before
    anything changes, when it cannot be mounted). At the end the databases that hold something
    there are dropped (they cannot outlive their disk), then the tablespace and the tmpfs."""
    if os.geteuid() != 0:
        raise MountRefused("mounting a tmpfs needs root")
    assert server.temp_dir is not None
    path = server.temp_dir / f"small_disk_{uuid.uuid4().hex[:8]}"
    path.mkdir()
    user = pwd.getpwnam(server.user)
    options = f"size={size_mb}m,mode=0700,uid={user.pw_uid},gid={user.pw_gid}"
    mounted = _run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])
    if mounted.returncode != 0:
        path.rmdir()
        raise MountRefused(f"mount -t tmpfs failed: {mounted.stderr.strip()}")
    disk = SmallDisk(server, path, path.name, [])
    name = sql.Identifier(disk.tablespace)
    try:
        with server.connect() as conn:
            conn.execute(sql.SQL("CREATE TABLESPACE {} LOCATION {}").format(name, str(path)))
        yield disk
    finally:
        try:
            if server.running:
                for database in dict.fromkeys(disk.databases):
                    server.drop_database(database)
                with server.connect() as conn:
                    conn.execute(sql.SQL("DROP TABLESPACE IF EXISTS {}").format(name))
        finally:
            unmounted = _run(["umount", str(path)])
            if unmounted.returncode != 0:
                raise AssertionError(f"umount {path} failed: {unmounted.stderr.strip()}")
            path.rmdir()


@contextlib.contextmanager
def disk_full(path: Path) -> Iterator[int]:
    """Fill the file system of directory `path` to the last page with a ballast file (written
    until the kernel answers ENOSPC) for the duration of the block; yield its size in bytes.
    The ballast is deleted at the end, and the space is free again at once."""
    ballast = path / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written = 0
        for block in (bytes(1 << 20), bytes(4096)):  # the last pages one by one
            while True:
                try:
                    written += os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        yield written
    finally:
        os.close(fd)
        ballast.unlink()


@contextlib.contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """SIGSTOP the process groups of `pids` (role processes, each leading its own group, with
    the worker processes a supervisor forks) for the duration of the block; SIGCONT after."""
    try:
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)


@dataclass
class Alarm:
    """How long a resource alarm took to go off after it was asked for, and to clear after
    the limit was set back (None until it has)."""

    raised_s: float = 0.0
    cleared_s: float | None = None


def memory_alarm(server: RabbitMQServer) -> contextlib.AbstractContextManager[Alarm]:
    """Hold the node's memory alarm for the duration of the block (see `_alarm`):
    ``rabbitmqctl set_vm_memory_high_watermark 0.0000001``, then 0.4 again."""
    watermark = "set_vm_memory_high_watermark"
    return _alarm(server, "memory", (watermark, ALARM_WATERMARK), (watermark, DEFAULT_WATERMARK))


def disk_alarm(server: RabbitMQServer) -> contextlib.AbstractContextManager[Alarm]:
    """Hold the node's disk alarm for the block (see `_alarm`): a free-disk limit of 1 PB, then
    the node's limit again (the test servers set 10MB). The command checks the disk at once: the
    alarm is on, and off, by the time it returns, not at the monitor's next check."""
    before = server.eval("rabbit_disk_monitor:get_disk_free_limit().")
    limit = "set_disk_free_limit"
    return _alarm(server, "disk", (limit, ALARM_DISK_LIMIT), (limit, before))


@contextlib.contextmanager
def _alarm(
    server: RabbitMQServer, resource: str, raise_it: tuple[str, str], clear_it: tuple[str, str]
) -> Iterator[Alarm]:
    """Run ``rabbitmqctl RAISE_IT`` (``RabbitMQServer.rabbitmqctl``): the block starts once the
    node's `resource` alarm is in force, and ends once ``rabbitmqctl CLEAR_IT`` has cleared it.
    Yields how long each took."""

    def on() -> bool:
        return resource in server.eval("rabbit_alarm:get_alarms().")

    alarm = Alarm()
    try:
        started = time.monotonic()
        server.rabbitmqctl(*raise_it)
        wait_until(on, timeout=30, interval=0.05, what=f"the {resource} alarm")
        alarm.raised_s = time.monotonic() - started
        yield alarm
    finally:
        if server.running:
            started = time.monotonic()
            server.rabbitmqctl(*clear_it)
            wait_until(lambda: not on(), timeout=30, interval=0.05, what="the alarm to clear")
            alarm.cleared_s = time.monotonic() - started


def _iptables(iptables: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([iptables, "-w", "5", *args], timeout=30)


def _rules(port: int) -> list[list[str]]:
    """Drop what reaches the port and what leaves it, on loopback only."""
    return [
        ["INPUT", "-p", "tcp", "--dport", str(port), "-i", "lo", "-j", "DROP"],
        ["OUTPUT", "-p", "tcp", "--sport", str(port), "-o", "lo", "-j", "DROP"],
    ]


def iptables_problem() -> tuple[str | None, str]:
    """(path of a working iptables, "") or (None, why not): installs Debian's ``iptables``
    when it is missing and we are root, then checks that a rule can be inserted and deleted."""
    iptables = shutil.which("iptables")
    if iptables is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return None, "iptables is not installed (apt-get install iptables, as root)"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "iptables"]
        for attempt in ([install], [["apt-get", "update", "-q"], install]):
            for args in attempt:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _run(args, env=env, timeout=300)
            iptables = shutil.which("iptables")
            if iptables is not None:
                break
        if iptables is None:
            return None, "iptables is not installed and apt-get install iptables failed"
    probe = _rules(9)[0]  # the discard port: nothing of ours listens there
    try:
        inserted = _iptables(iptables, "-I", *probe)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"iptables does not run: {exc!r}"
    if inserted.returncode != 0:
        return None, f"iptables cannot add a rule here: {inserted.stderr.strip()}"
    deleted = _iptables(iptables, "-D", *probe)
    if deleted.returncode != 0:
        return None, f"iptables cannot delete a rule here: {deleted.stderr.strip()}"
    return iptables, ""


@contextlib.contextmanager
def blackhole(iptables: str, port: int) -> Iterator[None]:
    """Drop every TCP packet to and from `port` on loopback while the block runs; the rules are
    deleted in a ``finally``, and checked gone (``iptables -C``)."""
    inserted: list[list[str]] = []
    try:
        for rule in _rules(port):
            result = _iptables(iptables, "-I", *rule)
            if result.returncode != 0:
                raise AssertionError(f"iptables -I {' '.join(rule)}: {result.stderr.strip()}")
            inserted.append(rule)
        yield
    finally:
        leftovers = []
        for rule in inserted:
            for _ in range(5):
                _iptables(iptables, "-D", *rule)
                if _iptables(iptables, "-C", *rule).returncode != 0:
                    break
                time.sleep(0.1)
            else:
                leftovers.append(" ".join(rule))
        if leftovers:
            raise AssertionError(f"iptables rules could not be removed: {leftovers}")
