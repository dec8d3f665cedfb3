"""Real PostgreSQL and RabbitMQ servers for the tests, and the installers of the test machine.

The servers themselves live in :mod:`outbox_inbox.testing.servers` (shipped, so ``bench/`` and
the tests import the same code without importing each other); this module re-exports every name
the tests import from ``servers``. What stays here is the setup of a test machine: installing
Debian's packages as root, which ``scripts/test`` runs as a script::

    .venv/bin/python tests/servers.py install-rabbitmq   # or install-postgres, install-chromium,
                                                         # install-pgbouncer; `run` (the default)
                                                         # starts both servers and prints their URLs
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from outbox_inbox.testing.servers import (
    PG_BIN_DIR,
    RABBITMQ_SBIN_DIR,
    ExternalPostgres,
    ExternalRabbitMQ,
    PostgresHandle,
    PostgresServer,
    RabbitMQHandle,
    RabbitMQServer,
    ServerError,
    _is_root,
    _signal_pid,
    free_port,
)

__all__ = [
    "PGBOUNCER_BIN",
    "PG_BIN_DIR",
    "RABBITMQ_SBIN_DIR",
    "ExternalPostgres",
    "ExternalRabbitMQ",
    "PostgresHandle",
    "PostgresServer",
    "RabbitMQHandle",
    "RabbitMQServer",
    "ServerError",
    "ensure_chromium_installed",
    "ensure_pgbouncer_installed",
    "ensure_postgres_installed",
    "ensure_rabbitmq_installed",
    "free_port",
]


# --------------------------------------------------------------------------------------------
# Installing the servers (Debian, as root)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """Debian's policy-rc.d: while it exits 101, package scripts start no services."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text(
        "#!/bin/sh\n# tests/servers.py: no services start while installing\nexit 101\n"
    )
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def _apt_install(*packages: str) -> None:
    if not _is_root():
        raise ServerError(
            f"{', '.join(packages)} not installed and we are not root: "
            f"run 'apt-get install {' '.join(packages)}' as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _services_not_started():
        for args in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        ):
            result = subprocess.run(
                args, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                raise ServerError(
                    f"{' '.join(args)} failed ({result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
                )


def _stop_system_service(
    service: str, user: str, process_names: tuple[str, ...], cmdline_marker: str = ""
) -> None:
    """Stop a system service that a package install may have started anyway: ``service NAME
    stop``, then SIGKILL what is left of it (processes of ``user`` with one of ``process_names``
    whose command line contains ``cmdline_marker``; our own servers never match)."""
    if shutil.which("service"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["service", service, "stop"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=120,
                check=False,
            )
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            owner = entry.stat().st_uid
            comm = (entry / "comm").read_text().strip()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if owner == uid and comm in process_names and cmdline_marker in cmdline:
            _signal_pid(int(entry.name), signal.SIGKILL)


def ensure_rabbitmq_installed(sbin_dir: Path | str = RABBITMQ_SBIN_DIR) -> bool:
    """Install Debian's rabbitmq-server if ``rabbitmq-server`` is missing (needs root).

    Returns True when it installed it. The package's own system service is kept from starting
    (and stopped and killed if it started all the same): our servers run as plain processes.
    """
    if (Path(sbin_dir) / "rabbitmq-server").exists():
        return False
    _apt_install("rabbitmq-server")
    _stop_system_service("rabbitmq-server", "rabbitmq", ("beam.smp", "epmd", "erl_child_setup"))
    if not (Path(sbin_dir) / "rabbitmq-server").exists():
        raise ServerError(f"rabbitmq-server installed, but {sbin_dir}/rabbitmq-server is missing")
    return True


def ensure_postgres_installed(bin_dir: Path | str = PG_BIN_DIR) -> bool:
    """Install Debian's postgresql-15 if its server binaries are missing (needs root).

    Returns True when it installed it; the package's own cluster service is stopped."""
    if (Path(bin_dir) / "postgres").exists():
        return False
    _apt_install("postgresql-15")
    _stop_system_service("postgresql", "postgres", ("postgres",), "/etc/postgresql/")
    if not (Path(bin_dir) / "postgres").exists():
        raise ServerError(f"postgresql-15 installed, but {bin_dir}/postgres is missing")
    return True


#: Where Debian's pgbouncer package puts its binary.
PGBOUNCER_BIN = Path(os.environ.get("OUTBOX_INBOX_PGBOUNCER_BIN", "/usr/sbin/pgbouncer"))


def ensure_pgbouncer_installed(binary: Path | str = PGBOUNCER_BIN) -> bool:
    """Install Debian's pgbouncer if its binary is missing (needs root).

    Returns True when it installed it; the package's own system service is stopped (the tests
    run their own PgBouncer as a plain process, tests/pooler/bouncer.py)."""
    if Path(binary).exists():
        return False
    _apt_install("pgbouncer")
    _stop_system_service("pgbouncer", "postgres", ("pgbouncer",), "/etc/pgbouncer/")
    if not Path(binary).exists():
        raise ServerError(f"pgbouncer installed, but {binary} is missing")
    return True


#: Names the Chromium binary has on PATH (Debian's package: chromium).
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def ensure_chromium_installed() -> bool:
    """Install Debian's chromium (and a font for its text) if no Chromium is on PATH (needs
    root). Returns True when it installed it; raises ServerError when it cannot, so that the
    browser tests never find it missing."""
    if any(shutil.which(name) for name in CHROMIUM_NAMES):
        return False
    _apt_install("chromium", "fonts-liberation")
    if not shutil.which("chromium"):
        raise ServerError("chromium installed, but no chromium binary is on PATH")
    return True


if __name__ == "__main__":  # pragma: no cover - used by scripts/test, and by hand
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = sys.argv[1] if len(sys.argv) > 1 else "run"
    if command == "install-rabbitmq":
        ensure_rabbitmq_installed()
    elif command == "install-postgres":
        ensure_postgres_installed()
    elif command == "install-chromium":
        ensure_chromium_installed()
    elif command == "install-pgbouncer":
        ensure_pgbouncer_installed()
    elif command == "run":  # start both, print their URLs, clean up on Ctrl-C or SIGTERM
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with PostgresServer() as pg, RabbitMQServer() as mq:
            print(pg.url("postgres"), mq.url, sep="\n", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    else:
        sys.exit(
            f"usage: {sys.argv[0]} [run | install-rabbitmq | install-postgres | install-chromium"
            " | install-pgbouncer]"
        )
