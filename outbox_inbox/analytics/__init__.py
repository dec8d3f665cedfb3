"""The message-history pipeline's analysis side: the PySpark audit, its report, and a generator of
synthetic history. Nothing is imported here: PySpark, pyarrow and numpy are optional extras
(``pip install 'outbox-inbox[spark]'``), loaded only by the modules that need them."""
