"""Benchmark: the raw limits of PostgreSQL + RabbitMQ, peer libraries and the outbox_inbox roles.

    .venv/bin/python bench/run.py [--messages 20000] [--db-url URL] [--mq-url URL] [--json FILE]

Without --db-url / --mq-url it starts its own PostgreSQL and RabbitMQ with
outbox_inbox.testing.servers.
Everything runs in one run, on the same servers, one phase after the other. bench/README.md
explains each figure. This is a benchmark, not a test: it only fails when a phase cannot finish.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from psycopg import sql

from bench import aio, fair, latency, peers, raw_mq, raw_pg, raw_pipeline, report, roles, rss
from bench.context import Context
from bench.timing import BenchError
from bench.wire import WINDOW, make_wires
from outbox_inbox.messages import from_wire

#: Groups of figures that --skip and --only choose from, in the order they run.
GROUPS = ("raw", "peers", "library", "processes", "async", "fair", "e2e", "latency", "memory")


def warm_up(ctx: Context) -> None:
    """Untimed: a first round trip through both servers, so no figure pays for a cold start."""
    assert ctx.params is not None
    k = min(1000, ctx.n)
    wires = make_wires(k, "warm-up", ctx.raw_exchange, "raw.window")
    raw_mq.raw_publish_window(ctx.params, ctx.raw_exchange, "raw.window", wires, WINDOW, 60)
    raw_mq.raw_consume(ctx.params, ctx.raw_queue, k, 60)
    raw_pg.raw_batch_insert(ctx.conninfo, ctx.t("inbox"), [from_wire(w) for w in wires])
    ctx.sql(sql.SQL("TRUNCATE {}").format(ctx.t("inbox")))


def run(ctx: Context) -> None:
    skip = set(ctx.args.skip)
    if ctx.args.only:
        skip |= set(GROUPS) - set(ctx.args.only)
    ctx.setup()
    warm_up(ctx)
    if "raw" not in skip:
        print(f"raw limits (best of {ctx.raw_repeats})", flush=True)
        raw_mq.measure(ctx)
        raw_pg.measure(ctx)
    if "peers" not in skip:
        print("\npeers", flush=True)
        peers.pgqueuer(ctx)
        peers.dramatiq(ctx)
    if "library" not in skip:
        print("\nlibrary broker layer (no database)", flush=True)
        roles.broker_layer(ctx)
        print("\nlibrary", flush=True)
        roles.relay_threads(ctx)
        roles.relay(ctx)
        roles.receiver(ctx)
        roles.worker_threads(ctx, 1)
        for style in ("noop", "orm", "write", "batch"):
            roles.worker_threads(ctx, 1, style)
        roles.worker_threads(ctx, 2)
    if "processes" not in skip:
        if "library" in skip:
            ctx.skipped("gp", "the worker processes need the inbox rows of (f): group 'library'")
        else:
            roles.worker_processes(ctx, 1)
            roles.worker_processes(ctx, 2)
            roles.worker_run(ctx)
    if "async" not in skip:
        if "library" in skip:
            ctx.skipped("ga", "the asyncio workers need the inbox rows of (f): group 'library'")
        else:
            print("\nasyncio", flush=True)
            aio.write_outbox_async(ctx)
            aio.asyncio_workers(ctx, 1)
            aio.asyncio_workers(ctx, 2)
    if "fair" not in skip:
        print("\nfair claims and caps", flush=True)
        fair.measure(ctx)
    if "e2e" not in skip:
        roles.end_to_end(ctx)
        raw_pipeline.create(ctx)
        raw_pipeline.end_to_end(ctx)
    if "latency" not in skip:
        print("\nlatency", flush=True)
        latency.measure(ctx)
    if "memory" not in skip:
        print("\nmemory", flush=True)
        rss.measure(ctx)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def group_list(value: str, groups: Sequence[str] = GROUPS) -> list[str]:
    """An argparse type: comma-separated names, each one of `groups`."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in groups]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(unknown)}; choose from {', '.join(groups)}"
        )
    return names


def _rates(value: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {value!r}") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
    _add_latency_and_memory_options(parser)
    args = parser.parse_args(argv)
    if args.messages < WINDOW:
        parser.error(f"--messages must be at least {WINDOW}")
    if args.raw_repeats < 1:
        parser.error("--raw-repeats must be at least 1")
    if (
        min(args.latency_rate) <= 0
        or args.latency_seconds <= 0
        or args.latency_warmup < 0
        or min(args.latency_writers, args.latency_writer_processes) < 1
    ):
        parser.error(
            "--latency-rate, --latency-seconds, --latency-writers and"
            " --latency-writer-processes must be positive, --latency-warmup not negative"
        )
    if args.memory_rows < 1 or args.memory_seconds < 0:
        parser.error("--memory-rows must be positive and --memory-seconds not negative")
    return args


def _parser() -> argparse.ArgumentParser:
    """The options of every run: size, servers, output, profiling and the groups."""
    doc = __doc__ or ""
    prog = "python -m bench" if sys.argv[0].endswith("__main__.py") else "bench/run.py"
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages per figure")
    parser.add_argument("--db-url", help="PostgreSQL URL of a database to use (default: start one)")
    parser.add_argument("--mq-url", help="amqp:// URL of a RabbitMQ to use (default: start one)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--phase-timeout", type=float, default=180.0, help="give up on a phase after this (s)"
    )
    parser.add_argument(
        "--raw-repeats",
        type=int,
        default=2,
        help="measure each raw limit this many times and keep the best (default 2)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run the library roles under cProfile, print the top functions and write DIR/*.prof"
        " (slows them down: the figures of such a run are not comparable)",
    )
    parser.add_argument(
        "--skip",
        type=group_list,
        action="extend",
        default=[],
        metavar="GROUP[,GROUP]",
        help=f"leave out groups of figures: {', '.join(GROUPS)}",
    )
    parser.add_argument(
        "--only",
        type=group_list,
        action="extend",
        default=[],
        metavar="GROUP[,GROUP]",
        help="run only these groups (processes and async need library)",
    )
    return parser


def _add_latency_and_memory_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--latency-rate",
        type=_rates,
        default=[100.0, 500.0, 1000.0],
        metavar="RATE[,RATE]",
        help="(L) offered messages per second, one run of each pipeline each (default"
        " 100,500,1000)",
    )
    parser.add_argument(
        "--latency-seconds", type=float, default=10.0, help="(L) how long the load is offered"
    )
    parser.add_argument(
        "--latency-warmup",
        type=float,
        default=1.0,
        help="(L) seconds of the same load offered first, its messages handled and reported"
        " apart as the cold start, not in the figures (default 1; 0: none)",
    )
    parser.add_argument(
        "--latency-writers",
        type=int,
        default=8,
        help="(L) threads per writer process committing outbox rows, sharing the schedule"
        " (default 8)",
    )
    parser.add_argument(
        "--latency-writer-processes",
        type=int,
        default=2,
        help="(L) processes of writer threads (default 2: one interpreter did not reach 1,000"
        " commits a second)",
    )
    parser.add_argument(
        "--memory-rows",
        type=int,
        default=1_000_000,
        help="(M) rows in the backlog the relay and the worker work through (default 1,000,000)",
    )
    parser.add_argument(
        "--memory-seconds",
        type=float,
        default=45.0,
        help="(M) stop each role after this long; 0 = when its backlog is done (default 45)",
    )


def guarded(ctx: Context, body: Callable[[Context], None]) -> int:
    """Run `body(ctx)`, then clean up whatever happened (SIGTERM and Ctrl-C included); return
    the exit status: 0, 1 when the bench failed, 130 when interrupted."""
    status = 0
    with _interrupt_on_sigterm():
        try:
            body(ctx)
        except KeyboardInterrupt:
            print("\ninterrupted; cleaning up", file=sys.stderr)
            status = 130
        except BenchError as exc:
            print(f"\nbenchmark failed: {exc}", file=sys.stderr)
            status = 1
        except Exception as exc:
            if _unwinding_an_interrupt(exc):  # e.g. py4j's next call, its socket cut by Ctrl-C
                print("\ninterrupted; cleaning up", file=sys.stderr)
                status = 130
            else:  # a bug, here or in the library: say where, and print what was measured
                traceback.print_exc()
                print("\nbenchmark failed", file=sys.stderr)
                status = 1
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
            try:
                ctx.cleanup()
            finally:
                signal.signal(signal.SIGINT, previous)
    return status


def _unwinding_an_interrupt(exc: BaseException) -> bool:
    """Whether `exc` was raised while a KeyboardInterrupt (Ctrl-C, or SIGTERM) was handled."""
    context = exc.__context__
    while context is not None and not isinstance(context, KeyboardInterrupt):
        context = context.__context__
    return context is not None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx = Context(args)
    started = time.monotonic()
    status = guarded(ctx, run)
    if ctx.figures or ctx.results:
        report.print_table(ctx)
        if args.json:
            report.write_json(ctx, args.json)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return status
