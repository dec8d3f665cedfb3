"""Entry point of the benchmark: ``.venv/bin/python bench/run.py --help`` (or ``python -m bench``).

The bench itself is the package `bench` beside this file (bench/README.md explains each figure).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = str(Path(__file__).resolve().parent)
# Run as a script, Python puts bench/ first on the path; the package needs the repository root
# instead (and bench/'s modules must not shadow top-level ones such as `profile`).
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(HERE)]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
