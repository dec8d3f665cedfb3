"""The claim check without servers: thresholds per type, references that cannot name a path,
and a store's database password kept out of the settings' text."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox_inbox import Message, Service
from outbox_inbox.claim_check import DirectoryPayloadStore, PostgresPayloadStore, resolve
from outbox_inbox.errors import ConfigurationError, PayloadMissing


def test_a_type_of_its_own_threshold_goes_by_reference_above_it_and_others_by_theirs(
    tmp_path: Path,
) -> None:
    store = DirectoryPayloadStore("files", str(tmp_path))
    svc = Service(
        "orders",
        db_url=f"sqlite:///{tmp_path / 'o.db'}",
        payload_store=store,
        claim_check_types={"orders.tiny.sent": 10},
    )
    svc.migrate()
    with svc.session() as session, session.begin():
        svc.outbox.publish(session, "tiny.sent", {"text": "x" * 20})  # over 10 bytes
        svc.outbox.publish(session, "other.sent", {"text": "x" * 20})  # under 4 KiB
        svc.outbox.publish(session, "other.sent", {"text": "x" * 5000})  # over 4 KiB
    with svc.engine.connect() as conn:
        sent = conn.execute(
            text("SELECT routing_key, payload FROM outbox_messages ORDER BY id")
        ).all()
    assert [(key, payload in (None, "null")) for key, payload in sent] == [
        ("orders.tiny.sent", True),
        ("orders.other.sent", False),
        ("orders.other.sent", True),
    ]
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith("o.db")]) == 2
    svc.close()


@pytest.mark.parametrize("key", ["../../etc/passwd", "x/../y", "", "not-a-uuid"])
def test_a_reference_whose_key_is_not_a_uuid_is_payload_missing_and_reads_no_file(
    tmp_path: Path, key: str
) -> None:
    store = DirectoryPayloadStore("files", str(tmp_path))
    headers = {"x-payload-ref": f"files/{key}", "x-payload-size": 2, "x-payload-sha256": "0"}
    message = Message(uuid.uuid4(), "orders.blob.stored", None, headers=headers)
    with pytest.raises(PayloadMissing, match="malformed"):
        resolve(message, [store])
    with pytest.raises(PayloadMissing, match="no payload store named 'files'"):
        resolve(message, [None, DirectoryPayloadStore("other", str(tmp_path))])


def test_a_payload_stores_database_password_is_not_in_the_settings_text() -> None:
    svc = Service(
        "orders",
        db_url="postgresql://app:s3cret@db/orders",
        payload_store=PostgresPayloadStore("orders"),
        payload_sources=[PostgresPayloadStore("billing", db_url="postgresql://r:t0p@db/b")],
    )
    assert svc.settings.payload_store is not None
    assert svc.settings.payload_store.db_url == "postgresql+psycopg://app:s3cret@db/orders"
    shown = repr(svc.settings)
    assert "s3cret" not in shown and "t0p" not in shown


def test_a_threshold_of_a_type_must_be_a_positive_whole_number() -> None:
    with pytest.raises(ConfigurationError, match="claim_check_types"):
        Service("orders", db_url="sqlite://", claim_check_types={"orders.a.b": 0})


def test_a_directory_store_makes_the_file_and_its_name_durable_before_put_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The business transaction commits after `put`: by then the file's bytes and its entry
    in the directory are both fsynced (a crash must not lose a payload a message names)."""
    import os
    import stat

    from outbox_inbox import claim_check

    synced: list[str] = []

    def fsync(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    real_fsync = os.fsync
    monkeypatch.setattr(claim_check.os, "fsync", fsync)
    key = str(uuid.uuid4())
    DirectoryPayloadStore("files", str(tmp_path)).put(None, key, b'{"a":1}')  # type: ignore[arg-type]
    assert synced == ["file", "directory"]
    assert (tmp_path / key).read_bytes() == b'{"a":1}'


def test_a_payload_by_reference_is_any_json_value_not_only_what_jsonb_stores(
    tmp_path: Path,
) -> None:
    """It never goes into a jsonb column, so the inline body's jsonb rules (U+0000, nesting
    past 256) are not checked: the worker only parses it (docs/wire-format.md)."""
    import hashlib

    store = DirectoryPayloadStore("files", str(tmp_path))
    data = b'{"text":"a\\u0000b","deep":' + b"[" * 300 + b"]" * 300 + b"}"
    key = str(uuid.uuid4())
    store.put(None, key, data)  # type: ignore[arg-type]
    headers = {
        "x-payload-ref": f"files/{key}",
        "x-payload-size": len(data),
        "x-payload-sha256": hashlib.sha256(data).hexdigest(),
    }
    message = resolve(Message(uuid.uuid4(), "orders.blob.stored", None, headers=headers), [store])
    assert message.payload["text"] == "a\x00b"
