"""Help, migrations and failures of the `outbox-inbox` command, run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli_support import Cli, base_env, command
from sqlalchemy import create_engine, text

from helpers import scalar

SECRET = "s3cretpw"

#: Every command and group, as a user would type it before --help.
COMMANDS = [
    (),
    ("db",),
    ("db", "upgrade"),
    ("db", "downgrade"),
    ("db", "current"),
    ("db", "history"),
    ("topology",),
    ("topology", "plan"),
    ("topology", "apply"),
    ("topology", "verify"),
    ("dead-letters",),
    ("dead-letters", "list"),
    ("dead-letters", "show"),
    ("dead-letters", "replay"),
    ("dead-letters", "purge"),
    ("status",),
    ("tail",),
    ("run",),
    ("archive",),
    ("audit",),
]


def _run_all(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str, str]]:
    """Run several commands at once (they are independent) and collect their results."""
    processes = [
        subprocess.Popen(
            command(*argv),
            cwd=cwd,
            env=base_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        results.append((process.returncode, out, err))
    return results


#: Prints the help of each command given as JSON argv lists, in one process: 18 interpreter
#: starts would cost the suite ~10 s on a small machine. The console script itself is run below.
_HELP_DRIVER = """
import contextlib, io, json, sys
from outbox_inbox.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main.main(argv + ["--help"], prog_name="outbox-inbox", standalone_mode=False)
    results.append([code or 0, out.getvalue()])
print(json.dumps(results))
"""


def test_help_of_every_command_explains_it_and_exits_0(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("outbox-inbox")
    console = subprocess.run(
        [str(script), "--help"], env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert console.returncode == 0, console.stderr
    assert console.stdout.startswith("Usage: outbox-inbox [OPTIONS] COMMAND")
    driver = subprocess.run(
        [sys.executable, "-c", _HELP_DRIVER, json.dumps([list(c) for c in COMMANDS])],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert driver.returncode == 0, driver.stderr
    results = json.loads(driver.stdout)
    for argv, (code, out) in zip(COMMANDS, results, strict=True):
        name = " ".join(argv) or "(root)"
        assert code == 0, f"{name} --help exited {code}"
        assert out.startswith("Usage: outbox-inbox"), f"{name}: {out[:200]}"
        # A summary sentence, not just the option list.
        description = out.split("\n\n")[1].strip()
        assert len(description) > 20, f"{name} --help has no description: {out}"
        for line in out.splitlines():
            assert len(line) <= 100, f"{name} --help has a line of {len(line)} characters"
    assert results[0][1] == console.stdout
    for group in ("db", "topology", "dead-letters", "status", "tail", "run"):
        assert f"  {group} " in console.stdout
    assert "--db-url" in results[COMMANDS.index(("status",))][1]
    assert "--mq-url" in results[COMMANDS.index(("dead-letters", "replay"))][1]
    assert "--management-url" in results[COMMANDS.index(("topology", "verify"))][1]


def test_bad_input_gives_one_error_line_exit_1_no_traceback_no_password(
    tmp_path: Path, db_url: str
) -> None:
    missing_tables_url = db_url.replace("postgres@", f"postgres:{SECRET}@", 1)
    assert SECRET in missing_tables_url  # the local server trusts loopback: it connects anyway
    cases = {
        "malformed db url": [
            "status",
            "--service",
            "billing",
            "--db-url",
            f"postgresql+psycopg://app:{SECRET}@db:notaport/x",
        ],
        "unreachable db": [
            "status",
            "--service",
            "billing",
            "--db-url",
            f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/x",
        ],
        "missing tables": ["status", "--service", "billing", "--db-url", missing_tables_url],
        "missing tables, dead letters": [
            "dead-letters",
            "list",
            "--source",
            "table",
            "--service",
            "billing",
            "--db-url",
            missing_tables_url,
        ],
        "unknown app": ["topology", "plan", "--app", "no_such_module:service"],
        "app not a service": ["topology", "plan", "--app", "os:sep"],
        "malformed mq url": ["tail", "orders.#", "--mq-url", f"http://app:{SECRET}@mq/"],
        "unreachable broker": ["tail", "orders.#", "--mq-url", f"amqp://app:{SECRET}@127.0.0.1:1/"],
        "unreachable db on upgrade": [
            "db",
            "upgrade",
            "--db-url",
            f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/x",
        ],
    }
    results = _run_all(list(cases.values()), tmp_path)
    for (case, argv), (code, out, err) in zip(cases.items(), results, strict=True):
        shown = f"{case}: {argv} -> {code}\nstdout: {out}\nstderr: {err}"
        assert code == 1, shown
        assert out == "", shown
        lines = err.strip().splitlines()
        assert len(lines) == 1, shown
        assert lines[0].startswith("error: "), shown
        assert "Traceback" not in err, shown
        assert SECRET not in err, shown
    by_case = dict(zip(cases, (err for _, _, err in results), strict=True))
    assert "malformed database URL" in by_case["malformed db url"]
    assert "db upgrade" in by_case["missing tables"]
    assert "db upgrade" in by_case["missing tables, dead letters"]
    assert "no_such_module" in by_case["unknown app"]
    assert "not an outbox_inbox.Service" in by_case["app not a service"]
    assert "malformed broker URL" in by_case["malformed mq url"]
    assert "cannot connect to RabbitMQ" in by_case["unreachable broker"]
    assert "***" in by_case["unreachable broker"]


def test_verbose_shows_the_traceback_still_masked(tmp_path: Path) -> None:
    ((code, _, err),) = _run_all(
        [["-v", "tail", "x.#", "--mq-url", f"amqp://app:{SECRET}@127.0.0.1:1/"]], tmp_path
    )
    assert code == 1
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("error: ")
    assert SECRET not in err


def test_version_and_help_import_neither_sqlalchemy_nor_pika_nor_psycopg(tmp_path: Path) -> None:
    """`--version` and `--help` load no command: the database and broker drivers (most of a
    second of imports) stay out. `-X importtime` lists every module the process imported."""
    for argv in (["--version"], ["--help"]):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *command(*argv)[1:]],
            cwd=tmp_path,
            env=base_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "outbox-inbox" in done.stdout
        imported = {
            line.rsplit("|", 1)[1].strip()
            for line in done.stderr.splitlines()
            if line.startswith("import time:")
        }
        assert "click" in imported and "outbox_inbox.cli.output" in imported  # it did run
        heavy = {m for m in imported if m.split(".")[0] in ("sqlalchemy", "pika", "psycopg")}
        assert not heavy, f"{argv}: {sorted(heavy)[:10]}"


def _app_modules(where: Path) -> None:
    """A module that fails at import (line 4), and one whose function returns no Service and
    counts its calls in calls.txt."""
    (where / "broken_app.py").write_text('import os\n\nx = 1\nraise RuntimeError("boom")\n')
    (where / "factory_app.py").write_text(
        "from pathlib import Path\n\n\ndef make():\n"
        "    with Path('calls.txt').open('a') as calls:\n"
        "        calls.write('called\\n')\n"
    )


def test_an_app_that_fails_at_import_is_one_line_with_its_file_and_line_and_v_traces_it(
    tmp_path: Path,
) -> None:
    _app_modules(tmp_path)
    where = f"{tmp_path / 'broken_app.py'}:4"
    plain, after, nested, before = _run_all(
        [
            ["status", "--app", "broken_app:service"],
            ["status", "--app", "broken_app:service", "-v"],  # -v after the command
            ["dead-letters", "list", "-vv", "--app", "broken_app:service"],
            ["-v", "topology", "plan", "--app", "broken_app:service"],
        ],
        tmp_path,
    )
    code, out, err = plain
    assert code == 1 and out == "", err
    assert err.strip().splitlines() == [
        f"error: --app broken_app:service: importing 'broken_app' raised RuntimeError: boom "
        f"(at {where})"
    ]
    for code, _, err in (after, nested, before):
        assert code == 1, err
        assert "Traceback (most recent call last)" in err
        assert f'File "{tmp_path / "broken_app.py"}", line 4' in err
        assert err.strip().splitlines()[-1].startswith("error: --app broken_app:service")


def test_an_app_that_fails_inside_the_standard_library_is_pointed_at_its_own_line(
    tmp_path: Path,
) -> None:
    # os.environ[...] raises its KeyError in <frozen os>: the line to fix is the app's.
    (tmp_path / "env_app.py").write_text('import os\n\nport = os.environ["NO_SUCH_SETTING"]\n')
    ((code, out, err),) = _run_all([["status", "--app", "env_app:service"]], tmp_path)
    assert code == 1 and out == "", err
    assert err.strip() == (
        "error: --app env_app:service: importing 'env_app' raised KeyError: 'NO_SUCH_SETTING' "
        f"(at {tmp_path / 'env_app.py'}:3)"
    )


def test_an_app_function_that_returns_no_service_is_called_once_and_named(
    tmp_path: Path,
) -> None:
    _app_modules(tmp_path)
    ((code, out, err),) = _run_all([["status", "--app", "factory_app:make"]], tmp_path)
    assert code == 1 and out == "", err
    assert err.strip() == (
        "error: --app factory_app:make: make() returned None; expected an outbox_inbox.Service"
    )
    assert (tmp_path / "calls.txt").read_text() == "called\n"


def test_a_missing_vhost_is_named_in_one_line(cli: Cli, mq_url: str) -> None:
    base = mq_url.rsplit("/", 1)[0]
    result = cli("tail", "x.#", "--mq-url", f"{base}/no_such_vhost", "--count", "1")
    assert result.returncode == 1, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot connect to RabbitMQ at amqp://"), line
    assert line.endswith(": vhost no_such_vhost does not exist (or user *** may not access it)")


def test_db_upgrade_current_history_downgrade(cli: Cli, db_url: str) -> None:
    fresh = cli("db", "current", "--db-url", db_url)
    assert fresh.returncode == 0, fresh
    assert "no revision" in fresh.stdout
    # `current` only reads: it creates neither the schema nor the version table.
    assert scalar(db_url, "SELECT count(*) FROM pg_namespace WHERE nspname = 'ops'") == 0

    up = cli("db", "upgrade", "--db-url", db_url, "--schema", "ops")
    assert up.returncode == 0, up
    assert "upgraded" in up.stdout
    assert scalar(db_url, "SELECT to_regclass('ops.inbox_messages') IS NOT NULL") is True

    current = cli("db", "current", "--db-url", db_url, "--schema", "ops", "--json")
    assert current.returncode == 0, current
    assert '"up_to_date": true' in current.stdout
    assert "0014 (head)" in cli("db", "current", "--db-url", db_url, "--schema", "ops").stdout

    checked = cli("db", "check", "--db-url", db_url, "--schema", "ops")
    assert checked.returncode == 0, checked
    assert "the tables are those of the newest migration" in checked.stdout
    with create_engine(db_url).begin() as conn:  # a change made by hand
        conn.execute(text("DROP INDEX ops.ix_outbox_messages_dead"))
    drifted = cli("db", "check", "--db-url", db_url, "--schema", "ops", "--json")
    assert drifted.returncode == 4, drifted
    assert any("ix_outbox_messages_dead" in d for d in json.loads(drifted.stdout)["differences"])
    with create_engine(db_url).begin() as conn:
        conn.execute(
            text(
                "CREATE INDEX ix_outbox_messages_dead ON ops.outbox_messages (id)"
                " WHERE dead_at IS NOT NULL"
            )
        )

    history = cli("db", "history")
    assert history.returncode == 0, history
    assert "0001" in history.stdout and "0002" in history.stdout

    # One step back: the history tables go, the outbox and inbox stay.
    back = cli("db", "downgrade", "0001", "--db-url", db_url, "--schema", "ops")
    assert back.returncode == 0, back
    assert scalar(db_url, "SELECT to_regclass('ops.subscriptions') IS NULL") is True
    assert scalar(db_url, "SELECT to_regclass('ops.inbox_messages') IS NOT NULL") is True

    down = cli("db", "downgrade", "base", "--db-url", db_url, "--schema", "ops")
    assert down.returncode == 0, down
    assert scalar(db_url, "SELECT to_regclass('ops.inbox_messages') IS NULL") is True


def test_db_upgrade_takes_the_database_from_the_app(cli: Cli, db_url: str) -> None:
    result = cli("db", "upgrade", "--app", "cli_app:billing")
    assert result.returncode == 0, result
    assert scalar(db_url, "SELECT to_regclass('outbox_inbox.outbox_messages') IS NOT NULL")
