"""`outbox-inbox run relay | receiver | worker | all`: a service's roles until SIGTERM."""

from __future__ import annotations

import logging
from dataclasses import replace

import click

from outbox_inbox.metrics import MetricsServer, instrument

from .target import db_url_option, fail, load_app, mq_url_option, resolve


@click.command()
@click.argument("role", type=click.Choice(["relay", "receiver", "worker", "all"]))
@click.option("--app", "app_spec", required=True, metavar="MODULE:ATTR", help="Your Service.")
@db_url_option
@mq_url_option
@click.option(
    "--fail-fast",
    is_flag=True,
    help="Exit at once when PostgreSQL or RabbitMQ cannot be reached at start, instead of"
    " waiting for them.",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Worker processes for `worker` and `all` (default: the service's `processes`"
    " setting, else one per CPU); 1 runs the workers in threads of this process.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    metavar="PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (docs/observability.md).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    metavar="HOST",
    help="The address the metrics server binds (0.0.0.0 for every interface).",
)
def run(
    role: str,
    app_spec: str,
    db_url: str | None,
    mq_url: str | None,
    fail_fast: bool,
    processes: int | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run one role of the service, or all, until SIGTERM or SIGINT (graceful stop).

    \b
    relay     publishes the outbox to RabbitMQ (and POSTs the webhooks, with `webhooks`)
    receiver  stores messages from <service>.inbox in the inbox table (declares the topology)
    worker    runs your handlers on the inbox rows, in --processes worker processes
    all       the relay and the receiver in threads of this process, the workers as `worker`

    Worker processes are started again when they die; SIGTERM stops them after their batch.

    A server that cannot be reached at start is waited for (one warning, then retries), unless
    --fail-fast is given. A configuration error (bad URL or credentials, missing schema) exits
    at once. On SIGTERM or SIGINT the work in hand is finished, then the command exits 0.

    With --metrics-port, Prometheus metrics of this process's roles and the service's backlog
    are served on 127.0.0.1 (--metrics-host to change); a port that cannot be bound exits 1.
    """
    resolve(db_url=db_url, mq_url=mq_url)  # checks the URLs before anything starts
    service = load_app(app_spec).with_urls(db_url=db_url, mq_url=mq_url)
    if processes is not None:
        service.settings = replace(service.settings, processes=processes)
    wait = {"fail_fast": True} if fail_fast else {}
    server: MetricsServer | None = None
    if metrics_port is not None:
        try:
            server = instrument(service).serve(metrics_port, metrics_host)
        except OSError as exc:
            service.close()
            fail(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc.strerror or exc}")
        logging.getLogger(__name__).info(
            "metrics at http://%s:%d/metrics", metrics_host, server.port
        )
    try:
        if role == "all":
            service.run(**wait)
        elif role == "relay":
            service.run_relay(**wait)
        elif role == "receiver":
            service.run_receiver(**wait)
        else:
            service.run_worker(**wait)
    finally:
        service.close()
        if server is not None:
            server.close()
