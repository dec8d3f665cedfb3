"""`cli/` parses options, calls the library and renders: no broker client, no database
toolkit, no adapter of the library's, no SQL of its own, and no function long enough to hide
library logic."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[2] / "cli"
LONGEST = 60


def _modules() -> list[Path]:
    found = sorted(CLI.glob("*.py"))
    assert len(found) > 5, f"no CLI modules found in {CLI}"
    return found


def _outside_the_library_api(name: str) -> bool:
    """pika and SQLAlchemy (the CLI gets engines, brokers and errors from the library), the
    RabbitMQ adapter (it reaches a broker through `Broker` and `Broker.operator`), and the
    library's SQL."""
    return (
        any(name == top or name.startswith(f"{top}.") for top in ("pika", "sqlalchemy"))
        or name.startswith("outbox_inbox.brokers.rabbitmq")
        or "queries" in name.split(".")
    )


def test_cli_imports_neither_pika_sqlalchemy_the_rabbitmq_adapter_nor_the_queries() -> None:
    offending = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            for name in names:
                if _outside_the_library_api(name):
                    offending.append(f"{path.name}:{node.lineno} imports {name}")
    assert not offending, offending


def test_no_cli_function_is_longer_than_60_lines() -> None:
    long = [
        f"{path.name}:{node.lineno} {node.name} has {node.end_lineno - node.lineno + 1} lines"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST
    ]
    assert not long, long
