"""The benchmark is a package of its own: it imports nothing from the test tree, and it runs.

`bench/` and `tests/` both start private servers with `outbox_inbox.testing.servers`; neither
imports the other. These checks need no server.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
TESTS = REPO_ROOT / "tests"
#: Top-level names that only exist in the test tree (tests/ is put on sys.path by conftest.py).
TEST_TREE_MODULES = {"tests", "conftest", *(p.stem for p in TESTS.glob("*.py"))}


def _bench_modules() -> list[Path]:
    modules = sorted(BENCH.glob("*.py"))
    assert len(modules) > 10, modules  # the package, not one file
    return modules


def _imported_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_bench_module_imports_the_test_tree() -> None:
    offenders = {}
    for path in _bench_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        bad = {n for n in _imported_names(tree) if n.split(".")[0] in TEST_TREE_MODULES}
        # an import by path (importlib's spec_from_file_location(..., ROOT / "tests" / ...))
        bad |= {
            f"path {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value == "tests" or node.value.startswith("tests/"))
        }
        if bad:
            offenders[path.name] = sorted(bad)
    assert offenders == {}


def test_importing_every_bench_module_loads_nothing_from_the_test_tree() -> None:
    names = [f"bench.{p.stem}" for p in _bench_modules() if p.stem != "__init__"]
    program = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "files = [getattr(m, '__file__', None) or '' for m in list(sys.modules.values())]\n"
        f"print(json.dumps(sorted(f for f in files if f.startswith({str(TESTS) + '/'!r}))))\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    # Run from the repository root with a clean path: `tests/` is not on it, as for a user.
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from_tests, loaded = (json.loads(line) for line in result.stdout.splitlines()[-2:])
    assert from_tests == []
    assert "outbox_inbox.testing.servers" in loaded  # where the bench's servers come from
    assert set(names) <= set(loaded)


def test_bench_run_py_help_lists_its_options() -> None:
    for command in (["bench/run.py", "--help"], ["-m", "bench", "--help"]):
        result = subprocess.run(
            [sys.executable, *command],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        for option in ("--messages", "--only", "--skip", "--db-url", "--mq-url", "--json"):
            assert option in result.stdout, (command, option)


def test_an_error_raised_while_an_interrupt_unwinds_exits_as_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from bench.cli import guarded

    class Cleaned:
        done = False

        def cleanup(self) -> None:
            self.done = True

    def interrupted(_ctx: object) -> None:
        try:
            raise KeyboardInterrupt
        finally:  # as a Spark call's exit does on a socket Ctrl-C cut
            raise ConnectionError("Answer from Java side is empty")

    def broken(_ctx: object) -> None:
        raise ConnectionError("a bug")

    ctx = Cleaned()
    assert guarded(ctx, interrupted) == 130  # type: ignore[arg-type]
    assert ctx.done
    assert guarded(Cleaned(), broken) == 1  # type: ignore[arg-type]
