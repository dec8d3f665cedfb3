"""Every SQL statement the library runs, named, built with SQLAlchemy Core, in one module per
audience: `roles` (what the outbox writer, relay, receiver, worker and waker run), `operations`
(dead letters, status, metrics), `archive` (the message history) and `partitions` (the partition
maintenance: its catalog reads and DDL). The test harness's own reads are in `outbox_inbox.testing`.
Each function takes the connection to run on as its first argument and never commits it: the caller
decides the transaction. Values always travel as bound parameters."""
