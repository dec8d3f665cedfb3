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


def test_every_package_directory_ships_in_the_wheel() -> None:
    """`pip install .` (not editable) installs only the packages pyproject lists: a package
    directory left out is missing from every installed copy, though an editable install and
    the tests still import it."""
    import tomllib

    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {path: package for package, path in config["package-dir"].items()}
    found = set()
    for path, package in roots.items():
        for init in (REPO_ROOT / path).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO_ROOT / path).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), "package directories pyproject.toml does not ship"
