"""``python -m bench``: the same as ``python bench/run.py``."""

import sys

from bench.cli import main

if __name__ == "__main__":  # not when a spawned child process imports this module again
    sys.exit(main())
