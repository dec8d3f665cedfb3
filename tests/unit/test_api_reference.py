"""The public API is what `__all__` says: the API reference builds from the docstrings (pdoc)
with every warning an error, has a page for every module that declares `__all__` and for no
other, documents only the names listed there, and needs none of the optional extras; and
every name the docs and examples import from the package is in its module's `__all__`."""

from __future__ import annotations

import importlib
import importlib.util
import os
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


REPO = SCRIPT.parents[1]


def _modules_on_disk() -> set[str]:
    """Every module of the installed package whose source says ``__all__ =``."""
    root = Path(outbox_inbox.__file__).parent
    found = {"outbox_inbox"}
    for path in root.rglob("*.py"):
        if re.search(r"^__all__ = ", path.read_text(), re.MULTILINE):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
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
    for module in ("outbox", "broker", "listener", "testing", "brokers.memory", "metrics"):
        assert f"outbox_inbox.{module}" in listed
    for internal in ("worker", "relay", "queries.roles", "supervisor", "brokers.memory._core"):
        assert f"outbox_inbox.{internal}" not in listed


def test_every_name_the_docs_and_examples_import_from_the_package_is_in_its_all() -> None:
    sources = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*")]
    outside = []
    for source in (s for s in sources if s.suffix in (".md", ".py")):
        for module, names in re.findall(
            r"^\s*from (outbox_inbox[\w.]*) import ([\w, ]+)$", source.read_text(), re.MULTILINE
        ):
            public = getattr(importlib.import_module(module), "__all__", [])
            wanted = [name.strip() for name in names.split(",")]
            outside += [f"{source.name}: {module}.{n}" for n in wanted if n not in public]
    assert outside == []


def test_the_api_reference_builds_without_extras_with_a_page_per_public_module(
    tmp_path: Path,
) -> None:
    out = tmp_path / "api"
    built = _script().build(out, env=_without_extras(tmp_path))
    assert built.returncode == 0, built.stderr[-3000:]
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    missing = [m for m in _modules_on_disk() if m.replace(".", "/") + ".html" not in pages]
    assert not missing, f"no page for {sorted(missing)}"
    extra = [
        p
        for p in pages
        if p.endswith(".html") and "/" in p and p[:-5].replace("/", ".") not in _modules_on_disk()
    ]
    assert not extra, f"pages of internal modules: {extra}"
    outbox = (out / "outbox_inbox" / "outbox.html").read_text()
    assert "publish" in outbox and "send" in outbox  # the docstrings are in it
    assert 'id="Outbox"' in outbox and 'id="WriteKeywords"' not in outbox  # __all__ only
    archive = re.sub(r"<[^>]*>", "", (out / "outbox_inbox" / "archive.html").read_text())
    assert "-&gt; pa.Schema" in archive  # an absent extra's type, shown as written
