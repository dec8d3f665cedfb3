"""Build the API reference of outbox_inbox's public modules from their docstrings (pdoc).

    python scripts/api_reference.py [OUTPUT_DIR]    (default: build/api)

The public API is what ``__all__`` says: the package and each of its modules that declares
``__all__`` get a page, documenting the names listed there and nothing else; a module
without ``__all__`` is internal and left out. Every warning is an error. The optional extras
(pyarrow, PySpark, numpy) need not be installed: an annotation naming one of their types is
shown as written.
tests/unit/test_api_reference.py runs this in CI, with the extras made absent.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

PACKAGE = "outbox_inbox"
#: The optional extras' top-level modules (`pip install 'outbox-inbox[spark]'`).
EXTRAS = ("pyarrow", "pyspark", "numpy")

# Run in the child: pdoc with warnings as errors. An extra that is not installed is stood in for
# by an empty module whose every attribute is a class of that name: the annotations that name
# its types (`pa.Schema`, `DataFrame`, imported under TYPE_CHECKING) then render as they do with
# the extra installed. The package itself imports the extras only inside the calls that use them.
_PDOC = f"""
import importlib.abc, importlib.machinery, runpy, sys, types, warnings

class _StandIn(types.ModuleType):
    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {{"__module__": self.__name__}})

class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass

absent = set()
for extra in {EXTRAS!r}:
    try:
        __import__(extra)
    except ImportError:
        absent.add(extra)
if absent:
    sys.meta_path.insert(0, _Absent(absent))
warnings.simplefilter("error")
# Every module is named, and pdoc walks a package's submodules too: named twice, one page.
warnings.filterwarnings("ignore", "The module specification .* has already been added", UserWarning)
sys.argv = ["pdoc", *sys.argv[1:]]
runpy.run_module("pdoc", run_name="__main__", alter_sys=True)
"""


def declares_all(path: Path) -> bool:
    """Whether the module at `path` assigns ``__all__`` at its top level."""
    tree = ast.parse(path.read_text(), str(path))
    targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def public_modules() -> list[str]:
    """The package and every module under it that declares ``__all__``, sorted."""
    root = Path(__import__(PACKAGE).__file__).parent
    names = [PACKAGE]
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and declares_all(path):
            names.append(".".join(parts))
    return sorted(names)


def build(out: Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run pdoc on every public module into `out` (from `out`'s parent directory, so that
    nothing in the current directory shadows a module), in `env` (default: this process's)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", _PDOC, *public_modules(), "-o", str(out.resolve())],
        cwd=out.parent,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "build/api")
    result = build(target)
    sys.stderr.write(result.stderr)
    if result.returncode == 0:
        print(f"API reference in {target}/index.html")
    sys.exit(result.returncode)
