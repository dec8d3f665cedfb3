"""A wheel built from the repository carries the CLI and the migrations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, inspect

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "migrations" / "versions"


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_wheel_installed_in_a_fresh_venv_runs_db_upgrade(tmp_path: Path, db_url: str) -> None:
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--wheel", "--outdir", dist, ROOT, cwd=tmp_path)
    (wheel,) = dist.glob("outbox_inbox-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _run(venv / "bin" / "pip", "install", "--quiet", wheel, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OUTBOX_INBOX_DB_URL"] = db_url
    # Run from a directory without the checkout, so only the installed wheel can answer.
    out = _run(
        venv / "bin" / "outbox-inbox",
        "db",
        "upgrade",
        "--schema",
        "wheel_check",
        cwd=tmp_path,
        env=env,
    )
    assert "upgraded" in out
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names(schema="wheel_check"))
    finally:
        engine.dispose()
    assert {"outbox_messages", "inbox_messages", "inbox_deliveries"} <= tables
    current = _run(
        venv / "bin" / "outbox-inbox",
        "db",
        "current",
        "--schema",
        "wheel_check",
        cwd=tmp_path,
        env=env,
    )
    head = max(p.name[:4] for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert f"{head} (head)" in current
