"""The API reference builds from the docstrings (pdoc) with every warning an error, has a page
for every public module, and needs none of the optional extras."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import outbox_inbox

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "api_reference.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules_on_disk() -> set[str]:
    """Every module of the installed package whose name has no `_`-prefixed part."""
    found = {"outbox_inbox"}
    for module in pkgutil.walk_packages(outbox_inbox.__path__, "outbox_inbox."):
        if not any(part.startswith("_") for part in module.name.split(".")):
            found.add(module.name)
    return found


def _without_extras(tmp_path: Path) -> dict[str, str]:
    """This environment with pyarrow, PySpark and numpy made absent: a package of each name
    first on the path whose import fails as a missing one does."""
    shadow = tmp_path / "no-extras"
    for name in ("pyarrow", "pyspark", "numpy"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), env.get("PYTHONPATH")]))
    return env


def test_every_public_module_is_listed_for_the_reference() -> None:
    listed = set(_script().public_modules())
    assert listed == _modules_on_disk()
    for module in ("outbox", "handlers", "payloads", "topology", "service", "brokers.memory"):
        assert f"outbox_inbox.{module}" in listed


def test_the_api_reference_builds_without_extras_with_a_page_per_public_module(
    tmp_path: Path,
) -> None:
    out = tmp_path / "api"
    built = _script().build(out, env=_without_extras(tmp_path))
    assert built.returncode == 0, built.stderr[-3000:]
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    missing = [m for m in _modules_on_disk() if m.replace(".", "/") + ".html" not in pages]
    assert not missing, f"no page for {sorted(missing)}"
    outbox = (out / "outbox_inbox" / "outbox.html").read_text()
    assert "publish" in outbox and "send" in outbox  # the docstrings are in it
    archive = re.sub(r"<[^>]*>", "", (out / "outbox_inbox" / "archive.html").read_text())
    assert "-&gt; pa.Schema" in archive  # an absent extra's type, shown as written
