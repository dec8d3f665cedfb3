"""The audit as a script for ``spark-submit``, which runs a file rather than a console command.

    spark-submit --master spark://host:7077 "$(python -m outbox_inbox.analytics.submit --path)" \\
        /shared/archive/orders /shared/archive/billing --out /shared/audit

takes the arguments of ``outbox-inbox audit``; without ``--master`` the audit runs where
spark-submit says. The driver needs this package installed; the executors need only Spark
(the job has no Python functions of its own), plus Python for reading live tables.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run ``outbox-inbox audit`` with `argv` (default: the command line)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--path"]:
        print(__file__)
        return
    from outbox_inbox.cli.main import main as cli

    cli(["audit", *args])


if __name__ == "__main__":
    main()
