"""Alembic environment and revisions of the outbox/inbox tables, shipped inside the package."""
