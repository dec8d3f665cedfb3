"""The `outbox-inbox` command line."""
