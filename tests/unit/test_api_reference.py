"""The API reference builds from the docstrings (pdoc) with every warning an error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "api_reference.py"


def _script() -> object:
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    script: object = _script()
    out = tmp_path / "api"
    built = script.build(out)  # type: ignore[attr-defined]
    assert built.returncode == 0, built.stderr[-3000:]
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    for module in script.PUBLIC:  # type: ignore[attr-defined]
        assert module.replace(".", "/") + ".html" in pages, f"no page for {module}"
    service = (out / "outbox_inbox" / "service.html").read_text()
    assert "on_command" in service and "outbox" in service  # the docstrings are in it
