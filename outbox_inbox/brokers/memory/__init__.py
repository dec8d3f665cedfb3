"""An in-memory message broker that behaves like RabbitMQ 3.10 in what the library declares.

One `MemoryBroker` object is one broker: the services of one process given the same object talk to
each other through it, as through one RabbitMQ server. It needs no server, which makes it right for
development, demos and users' own tests, and wrong for anything else: **nothing is durable**. Every
message lives in this process's memory and is gone when the process ends or the broker is closed, so
the outbox/inbox guarantees stop at the broker.

It keeps what `outbox_inbox.topology.service_topology` declares, as RabbitMQ does it: the shipped
broker contract runs the same cases on both, and docs/testing.md ("Testing a broker") says what it
keeps and refuses. TTL messages expire at the head, on time, by a timer thread. Beyond that only
``max_message_bytes``, a user's setting: a larger body is refused as RabbitMQ refuses it.

Thread safety: a `MemoryBroker` may be shared by any number of threads; its state sits behind one
lock. One daemon timer thread per broker expires TTL messages; `MemoryBroker.close` stops it.
Publishers, consumers and operators follow the `outbox_inbox.broker` rule (one per thread).
"""

from ._broker import MemoryBroker

__all__ = ["MemoryBroker"]
