"""The FastAPI example (examples/fastapi_orders) under uvicorn, talking to examples/billing.

Two real processes, two databases, one RabbitMQ: a real HTTP POST writes the order and its
messages in one AsyncSession transaction; billing invoices it; the reply is handled by the
example's ``async def`` handler in the asyncio worker, and the order shows invoiced.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import httpx
from sqlalchemy import create_engine, text

from .test_examples_with_servers import (
    ExampleProcess,
    free_port,
    queue_exists,
    start_example,  # noqa: F401 - the fixture
    wait_for,
)


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None  # nothing listens yet


def test_fastapi_order_is_written_with_its_messages_and_the_async_handler_takes_the_reply(
    start_example: Callable[..., ExampleProcess],  # noqa: F811 - the imported fixture
    db_url_factory: Callable[[], str],
    mq_url: str,
) -> None:
    billing_db, orders_db = db_url_factory(), db_url_factory()
    port = free_port()
    billing = start_example("billing", billing_db)
    orders = start_example("fastapi_orders", orders_db, "--port", str(port))
    processes = [billing, orders]
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: queue_exists(mq_url, "billing.inbox"), "billing's queue", processes)
    wait_for(
        lambda: (r := _get(f"{base}/health")) is not None and r.status_code == 200,
        "uvicorn to serve",
        processes,
    )

    refused = httpx.post(f"{base}/orders", json={"customer": "ada", "total_cents": 0})
    assert refused.status_code == 422  # validated before any transaction: nothing written
    response = httpx.post(
        f"{base}/orders",
        json={"customer": "ada", "total_cents": 4200},
        headers={"X-Correlation-Id": "checkout-1"},
    )
    assert response.status_code == 201, response.text
    order = response.json()
    assert order["status"] == "placed"

    invoiced = wait_for(
        lambda: (
            (r := _get(f"{base}/orders/{order['id']}")) is not None
            and r.json()["status"] == "invoiced"
            and r.json()
        ),
        "the order to be invoiced",
        processes,
    )
    engine = create_engine(billing_db)
    try:
        with engine.connect() as conn:
            invoices = conn.execute(text("SELECT id, order_id, amount_cents FROM invoices")).all()
            account = conn.execute(text("SELECT orders FROM accounts WHERE customer = 'ada'"))
            correlations = conn.execute(
                text("SELECT DISTINCT correlation_id FROM outbox_inbox.inbox_messages")
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in invoices] == [(invoiced["invoice_id"], order["id"], 4200)]
    assert account.scalar() == 1  # the orders.order.placed event reached billing too
    assert [c for (c,) in correlations] == ["checkout-1"]
    engine = create_engine(orders_db)
    try:
        with engine.connect() as conn:
            handled = conn.execute(
                text("SELECT routing_key, status FROM outbox_inbox.inbox_messages")
            ).all()
            orders_count = conn.execute(text("SELECT count(*) FROM orders")).scalar()
    finally:
        engine.dispose()
    assert [tuple(r) for r in handled] == [("billing.invoice.created", "processed")]
    assert orders_count == 1  # the refused POST wrote nothing

    # uvicorn ends the lifespan on SIGTERM (the roles stop), then re-raises the signal.
    assert orders.stop(timeout=20) in (0, -signal.SIGTERM), orders.log()[-4000:]
    assert "Application shutdown complete" in orders.log()
    assert billing.stop(timeout=20) == 0, billing.log()[-4000:]
