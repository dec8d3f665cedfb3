"""The linters are part of the test suite: ruff on the whole repository, mypy on the library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_ruff_check_passes() -> None:
    result = _run("ruff", "check", ".")
    if result.returncode != 0:
        pytest.fail(f"ruff check . failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@pytest.mark.timeout(900)
def test_mypy_passes() -> None:
    """mypy with the [tool.mypy] configuration of pyproject.toml (strict, on the library)."""
    result = _run("mypy")
    if result.returncode != 0:
        pytest.fail(f"mypy failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
