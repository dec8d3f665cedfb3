"""The benchmark of outbox_inbox: raw limits of PostgreSQL and RabbitMQ, peer libraries and the
library's roles, measured side by side on the same servers (bench/README.md).

Run it with ``.venv/bin/python bench/run.py`` or ``.venv/bin/python -m bench``.

Modules: `timing` (wall and CPU time, figures, background threads), `wire` (the messages every
figure moves), `raw_mq` and `raw_pg` (the raw limits), `peers` (pgqueuer and dramatiq),
`services` (the bench's services and the code its child processes run), `roles` (the relay,
receiver and worker), `latency`, `rss` (resident memory over a backlog), `report` (the table,
the targets and the JSON file), `context` (servers, connections, cleanup) and `cli` (options and
the order of the phases).
"""
