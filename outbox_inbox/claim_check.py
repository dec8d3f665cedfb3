"""The claim check: a payload over a threshold goes to a payload store, by reference; the
worker reads it back (`resolve`) before a handler sees it. No store falls back to another
(docs/concepts.md, "Large payloads"; the reference: docs/wire-format.md)."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Connection, create_engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from .config import validate_db_url, validate_identifier
from .database import DEFAULT_SCHEMA, Database, client_bounds, connect, is_sqlite, tables_for
from .errors import ConfigurationError, InvalidMessage, PayloadMissing, StorageError, storage_error
from .messages import H_PAYLOAD_REF, H_PAYLOAD_SHA256, H_PAYLOAD_SIZE, Message, decode_body
from .queries import archive, roles
from .tables import build_tables


class PayloadStore(Protocol):
    """Where payloads sent by reference are kept: the port a store implements (an S3 bucket would
    too). `name` is what references carry (``<name>/<key>``), and how receivers find it. `put`
    stores `data` under `key` (a UUID) in the writer's `session` (its transaction, for a store that
    can join it), and raises StorageError when it cannot. `get` returns the bytes, raises
    PayloadMissing when there are none, and anything else when the store cannot be read now (the
    message is then retried). `delete_older_than` removes what was put more than `seconds` ago and
    returns how many. Each method may be called from any thread."""

    name: str

    def put(self, session: Session | Connection, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def delete_older_than(self, seconds: float) -> int: ...


@dataclass(frozen=True)
class PostgresPayloadStore:
    """Payloads in the ``payloads`` table of the sender's database at `db_url` (None in a
    service's ``payload_store``: its own), written in the sender's transaction (a rollback
    leaves nothing). Works on SQLite too (development)."""

    name: str
    db_url: str | None = field(default=None, repr=False)  # its password: never in a log line
    schema: str = DEFAULT_SCHEMA

    def __post_init__(self) -> None:
        validate_identifier(self.name, "payload store")
        if self.db_url:
            object.__setattr__(self, "db_url", validate_db_url(self.db_url))

    def put(self, session: Session | Connection, key: str, data: bytes) -> None:
        tables = build_tables(self.schema if roles.is_postgres(session) else None)
        try:
            roles.insert_payload(session, tables, key, data)
        except SQLAlchemyError as exc:
            raise storage_error(exc, f"writing to payload store {self.name!r}") from exc

    def get(self, key: str) -> bytes:
        db = _database(self.name, self.db_url, self.schema)
        try:  # a StorageError: a handler failure, retried (not the worker's own connection)
            with db.engine.connect() as conn:
                data = roles.read_payload(conn, db.tables, key)
        except SQLAlchemyError as exc:
            raise storage_error(exc, f"reading payload store {self.name!r}") from exc
        if data is None:
            raise PayloadMissing(f"payload {self.name}/{key} is not in its store (removed?)")
        return bytes(data)

    def delete_older_than(self, seconds: float) -> int:
        db = _database(self.name, self.db_url, self.schema)
        with db.engine.begin() as conn:
            return archive.prune_payloads(conn, db.tables, seconds)


@cache
def _database(name: str, url: str | None, schema: str) -> Database:
    """The store's engine: no pool on PostgreSQL (a connection a read, safe across forks)."""
    if not url:
        raise ConfigurationError(f"payload store {name!r} needs the db_url it is in")
    if is_sqlite(url):
        return connect(url, schema)
    engine = create_engine(url, poolclass=NullPool, connect_args=client_bounds(url))
    return Database(engine, tables_for(url, schema))


@dataclass(frozen=True)
class DirectoryPayloadStore:
    """Payloads as files in `path`, a directory every sender and receiver mounts, written and
    fsynced (the file, then the directory) by `put`, not in the transaction: one that rolls
    back leaves its file until `delete_older_than` removes it."""

    name: str
    path: str

    def __post_init__(self) -> None:
        validate_identifier(self.name, "payload store")

    def put(self, session: Session | Connection, key: str, data: bytes) -> None:
        try:  # a fresh key, read once the transaction naming it commits: no rename needed
            with Path(self.path, key).open("wb") as file:
                file.write(data)
                os.fsync(file.fileno())
            directory = os.open(self.path, os.O_RDONLY)  # and its name, before the row
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise StorageError(f"payload store {self.name!r} cannot be written: {exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return Path(self.path, key).read_bytes()
        except FileNotFoundError as exc:
            raise PayloadMissing(f"payload {self.name}/{key} is not in {self.path}") from exc

    def delete_older_than(self, seconds: float) -> int:
        cutoff, deleted = time.time() - seconds, 0
        for entry in os.scandir(self.path):
            if entry.is_file() and entry.stat().st_mtime < cutoff:
                Path(entry.path).unlink(missing_ok=True)
                deleted += 1
        return deleted


def read(headers: Mapping[str, Any], stores: Iterable[PayloadStore | None]) -> bytes | None:
    """The bytes of the payload `headers` refer to (None without a reference), read from the
    store of that name among `stores` and checked against its size and SHA-256 (PayloadMissing
    if they cannot be had). What a store raises otherwise is raised."""
    ref = headers.get(H_PAYLOAD_REF)
    if ref is None:
        return None
    name, _, key = str(ref).partition("/")
    store = next((s for s in stores if s is not None and s.name == name), None)
    if store is None:
        raise PayloadMissing(f"payload {ref}: no payload store named {name!r} here")
    try:
        uuid.UUID(key)  # a key is a UUID: never a path out of a directory store
    except ValueError:
        raise PayloadMissing(f"payload reference {ref!r} is malformed") from None
    data = store.get(key)
    size, digest = headers.get(H_PAYLOAD_SIZE), headers.get(H_PAYLOAD_SHA256)
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise PayloadMissing(f"payload {ref} does not match its size and SHA-256")
    return data


def resolve(message: Message, stores: Iterable[PayloadStore | None]) -> Message:
    """`message` with the payload its reference names (`read`), parsed; else itself."""
    if (data := read(message.headers, stores)) is None:
        return message
    try:  # never stored as jsonb: any JSON value will do (docs/wire-format.md)
        return replace(message, payload=decode_body(data, jsonb=False))
    except InvalidMessage as exc:
        raise PayloadMissing(f"payload {message.headers[H_PAYLOAD_REF]}: {exc}") from exc


__all__ = ["DirectoryPayloadStore", "PayloadStore", "PostgresPayloadStore"]
