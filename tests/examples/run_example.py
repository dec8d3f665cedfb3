"""Run an example's script as ``__main__``, dying with the test process that started it.

python run_example.py PATH/TO/app.py [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the test that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the prctl
            os._exit(1)


if __name__ == "__main__":
    _die_with_parent()
    script, *arguments = sys.argv[1:]
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
