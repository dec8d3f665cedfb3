"""orders, the asyncio way: a FastAPI service on SQLAlchemy's AsyncSession.

``POST /orders`` writes the order row, the event ``orders.order.placed`` and the command
``billing.invoice.create`` in ONE ``AsyncSession`` transaction: all three commit, or none. The
``async def`` handler of ``billing.invoice.created`` marks the order invoiced through the
AsyncSession the worker gives it, in the transaction that marks the reply processed. The relay,
the receiver and the asyncio workers run in the app's lifespan. It talks to examples/billing
exactly as examples/shop does (see examples/README.md):

    OUTBOX_INBOX_DB_URL=postgresql+psycopg://postgres@127.0.0.1/orders \\
    OUTBOX_INBOX_MQ_URL=amqp://guest:guest@127.0.0.1/ \\
    python examples/fastapi_orders/app.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox_inbox import Message, Reject, Service


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]
    status: Mapped[str] = mapped_column(default="placed")  # placed -> invoiced
    invoice_id: Mapped[int | None]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "customer": self.customer,
            "total_cents": self.total_cents,
            "status": self.status,
            "invoice_id": self.invoice_id,
        }


class NewOrder(BaseModel):
    customer: str = Field(min_length=1)
    total_cents: int = Field(gt=0)


def create_service(db_url: str, mq_url: str) -> Service:
    """The orders service and its one handler, an ``async def``."""
    orders = Service("orders", db_url=db_url, mq_url=mq_url)

    @orders.on_event("billing.invoice.created")
    async def invoice_created(message: Message, session: AsyncSession) -> None:
        # `session` is in the transaction that marks this reply processed: the order's new
        # status commits with that mark, or neither does (and the reply is handled again).
        order = await session.get(Order, message.payload["order_id"])
        if order is None:
            raise Reject(f"no order {message.payload['order_id']}")
        order.status = "invoiced"
        order.invoice_id = message.payload["invoice_id"]

    return orders


def create_app(db_url: str, mq_url: str) -> FastAPI:
    """The web app; its lifespan prepares the database and runs the service's roles."""
    orders = create_service(db_url, mq_url)
    # The app's own engine: psycopg's async driver (the same postgresql+psycopg:// URL).
    engine = create_async_engine(db_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    def prepare() -> None:
        orders.migrate()
        sync_engine = create_engine(db_url)
        try:
            Base.metadata.create_all(sync_engine)
        finally:
            sync_engine.dispose()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(prepare)
        await orders.start_async()  # relay + receiver (threads) + asyncio workers (tasks)
        try:
            yield
        finally:
            await orders.stop_async()  # each worker finishes its batch in hand
            await engine.dispose()
            orders.close()

    app = FastAPI(title="orders", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(
        new: NewOrder, x_correlation_id: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        # One id for everything this request causes, in every service it reaches.
        correlation_id = x_correlation_id or str(uuid.uuid4())
        async with sessions() as session, session.begin():
            order = Order(customer=new.customer, total_cents=new.total_cents)
            session.add(order)
            await session.flush()  # assigns order.id
            await orders.outbox.publish_async(
                session,
                "order.placed",
                {"order_id": order.id, "customer": order.customer, "total_cents": new.total_cents},
                key=f"order-{order.id}",
                correlation_id=correlation_id,
            )
            await orders.outbox.send_async(
                session,
                "billing",
                "invoice.create",
                {"order_id": order.id, "amount_cents": order.total_cents},
                key=f"order-{order.id}",
                correlation_id=correlation_id,
            )
        # Committed: the order and both messages, together.
        return order.to_json()

    @app.get("/orders/{order_id}")
    async def get_order(order_id: int) -> dict[str, Any]:
        async with sessions() as session:
            order = await session.get(Order, order_id)
            if order is None:
                raise HTTPException(404, f"no order {order_id}")
            return order.to_json()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    db_url, mq_url = os.environ.get("OUTBOX_INBOX_DB_URL"), os.environ.get("OUTBOX_INBOX_MQ_URL")
    if not db_url or not mq_url:
        sys.exit("set OUTBOX_INBOX_DB_URL and OUTBOX_INBOX_MQ_URL (see examples/README.md)")
    # uvicorn runs the lifespan, and ends it on SIGTERM / Ctrl-C: the roles stop gracefully.
    uvicorn.run(create_app(db_url, mq_url), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
