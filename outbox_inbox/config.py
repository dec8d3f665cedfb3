"""Settings of a service, with every default in one place (documented in docs/configuration.md)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal, TypeGuard

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .errors import ConfigurationError
from .logsafe import mask_text, mask_url, remember
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .claim_check import PayloadStore
    from .webhooks import Webhook

#: An unquoted PostgreSQL identifier of at most 63 bytes: what a schema name may be.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
#: A service name becomes part of routing keys and queue names: no dots, no wildcards.
_SERVICE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")

DB_URL_ENV = "OUTBOX_INBOX_DB_URL"
MQ_URL_ENV = "OUTBOX_INBOX_MQ_URL"


def validate_identifier(value: str, what: str = "schema") -> str:
    """Return `value` if it is a lower-case SQL identifier, else raise ConfigurationError."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ConfigurationError(
            f"invalid {what} name {value!r}: use lower-case letters, digits and _ "
            "(starting with a letter or _, at most 63 characters)"
        )
    return value


#: The database URL schemes the library runs on: PostgreSQL through psycopg 3, and SQLite.
_DRIVERS = {"postgresql+psycopg", "sqlite", "sqlite+pysqlite"}
#: Schemes that mean PostgreSQL without naming psycopg 3, read as psycopg 3 (libpq's
#: ``postgres://``, as many platforms give DATABASE_URL; SQLAlchemy's default driver).
_POSTGRES_ALIASES = {"postgres", "postgresql"}


def validate_db_url(url: str) -> str:
    """Return `url` if the library can run on it, else raise ConfigurationError (masked).

    ``postgres://`` and ``postgresql://`` are returned as ``postgresql+psycopg://`` (the
    library's driver); another driver or database (``postgresql+psycopg2://``,
    ``mysql://``) is refused here, not at the first connection. The parser's error quotes the
    URL: it is reported masked and not chained. Its password is masked from now on (`remember`)."""
    remember(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"malformed database URL {mask_url(url)}: {mask_text(exc, url)}; "
            "expected a URL like postgresql+psycopg://user@host:5432/dbname"
        ) from None
    if parsed.host and "@" in parsed.host:
        # SQLAlchemy ends the password at its first "@": the rest would be taken for a host
        # name, and printed as one in every connection error.
        raise ConfigurationError(
            f"malformed database URL {mask_url(url)}: an '@' in the password must be written %40"
        )
    if parsed.drivername in _POSTGRES_ALIASES:
        url = "postgresql+psycopg:" + url.split(":", 1)[1]  # the rest exactly as written
    elif parsed.drivername not in _DRIVERS:
        raise ConfigurationError(
            f"database URL {mask_url(url)}: {parsed.drivername}:// is not supported; the library"
            " runs on PostgreSQL through psycopg 3 (postgresql+psycopg://user@host:5432/dbname)"
            " or on SQLite (sqlite:///path.db)"
        )
    if "host" in parsed.query and "port" not in parsed.query:
        return _host_list(url)
    return url


#: One ``host:port`` of a host list (an IPv6 address in brackets).
_HOST_PORT = re.compile(r"^(\[[^\]]*\]|[^:]*):(\d+)$")


def _host_list(url: str) -> str:
    """`url` with the hosts of its query (``?host=a:5432,b:5433`` as libpq's URIs write them,
    or ``?host=a:5432&host=b:5433`` as SQLAlchemy's do) as ``?host=a,b&port=5432,5433``.

    The one form both read alike: SQLAlchemy takes the first for a single host named
    "a:5432,b:5433", and libpq (the LISTEN connection, `waker.psycopg_conninfo`) keeps the last
    host of the second. A failover URL (docs/failures.md) names every server this way."""
    parsed = make_url(url)
    given = parsed.query["host"]
    values = [given] if isinstance(given, str) else list(given)
    pairs = [
        m.groups() if (m := _HOST_PORT.match(entry)) else (entry, "")
        for value in values
        for entry in value.split(",")
    ]
    if len(values) == 1 and not any(port for _, port in pairs):
        return url  # hosts without ports, or a socket directory: read alike already
    query = {"host": ",".join(host.strip("[]") for host, _ in pairs)}
    if any(port for _, port in pairs):
        query["port"] = ",".join(port for _, port in pairs)
    return parsed.update_query_dict(query).render_as_string(hide_password=False)


_AMQP_URL = re.compile(r"^(amqps?://)([^/?#]*)(.*)$", re.IGNORECASE | re.DOTALL)


def broker_urls(url: str) -> list[str]:
    """The one-host AMQP URLs `url` names, in order: a role connects to the first that answers.

    `url` is one URL, a URL whose host part lists several hosts separated by commas (each
    host gets the URL's user, password, virtual host and options), or several URLs
    separated by commas. Raises ConfigurationError (password masked) for anything else."""
    remember(url)
    urls: list[str] = []
    for part in re.split(r",(?=amqps?://)", url.strip(), flags=re.IGNORECASE):
        found = _AMQP_URL.match(part)
        if found is None or re.search(r",\s*[a-z][a-z0-9+.-]*:/", part, re.IGNORECASE):
            raise ConfigurationError(
                f"malformed broker URL {mask_url(url)}: expected a URL like "
                "amqp://user:password@host:5672/vhost (several hosts: host1:5672,host2:5672)"
            )
        scheme, netloc, rest = found.groups()
        userinfo, at, hosts = netloc.rpartition("@")
        for host in hosts.split(","):
            if not host.strip():
                raise ConfigurationError(f"malformed broker URL {mask_url(url)}: an empty host")
            urls.append(f"{scheme}{userinfo}{at}{host.strip()}{rest}")
    return urls


def validate_service_name(value: str) -> str:
    """Return `value` if it can name a service in routing keys and queues."""
    if not isinstance(value, str) or not _SERVICE_NAME.match(value):
        raise ConfigurationError(
            f"invalid service name {value!r}: use lower-case letters, digits, _ and - "
            "(starting with a letter, no dots or wildcards)"
        )
    return value


@dataclass(frozen=True)
class Tenant:
    """Where one tenant's outbox and inbox live (docs/tenants.md): the database at `db_url`
    (else the service's) and `schema` (else the service's)."""

    db_url: str | None = None
    schema: str | None = None


#: The tenant registry of a `Service`: tenant id to `Tenant`, or a callable returning such a
#: mapping, called anew each time the service reads its tenants (`Service.tenant_ids`).
Tenants = Mapping[str, Tenant] | Callable[[], Mapping[str, Tenant]]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Tunables of a `Service`. Every field is a keyword argument of `Service`; what each
    means: docs/configuration.md (the retention's: docs/history.md, "Retention")."""

    db_url: str | None = None
    mq_url: str | None = None
    schema: str = "outbox_inbox"
    listen_url: str | None = None
    prepare_threshold: int | Literal["auto"] | None = "auto"

    # outbox
    max_payload_bytes: int = 1024 * 1024
    payload_store: PayloadStore | None = None
    claim_check_bytes: int = 4096
    claim_check_types: Mapping[str, int] = field(default_factory=dict)
    payload_sources: tuple[PayloadStore, ...] = ()

    # relay
    relay_batch_size: int = 500
    publish_window: int = 500
    confirm_timeout: float = 30.0
    relay_poll_interval: float = 1.0
    relay_retry_initial: float = 1.0
    relay_retry_max: float = 60.0
    relay_max_attempts: int = 5
    relay_threads: int = 1
    publisher_connections: int = 2
    publisher_checkout_timeout: float = 5.0

    # webhooks out (outbox_inbox.webhooks)
    webhooks: tuple[Webhook, ...] = ()
    webhook_schedule: tuple[float, ...] = (5, 300, 1800, 7200, 18000, 36000, 36000)
    webhook_timeout: float = 15.0

    # receiver
    prefetch: int = 500
    receive_batch_size: int = 250
    single_active_consumer: bool = True
    receive_retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(
            initial=1, multiplier=2, max_interval=1800, max_attempts=12
        )
    )
    delay_tiers: tuple[float, ...] = (1, 5, 10, 30, 60, 300, 1800)
    max_redeliveries: int = 5
    max_message_bytes: int = 1024 * 1024

    # inbox queue options (part of the queue's arguments: changing one needs a new queue)
    queue_type: str = "classic"
    delivery_limit: int | None = None
    inbox_max_length: int | None = None
    max_priority: int | None = None

    # worker
    worker_batch_size: int = 50
    fair_claims: bool = True
    tenant_weights: Mapping[str, int] = field(default_factory=dict)
    worker_threads: int = 1
    processes: int | None = None
    lease: float = 60.0
    abandon_after: int = 3
    no_handler_grace: float = 300.0
    worker_poll_interval: float = 0.5
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    event_faults: bool = False

    # topology
    declare: bool = True

    # retention (PostgreSQL: time partitions, outbox_inbox.partitions)
    partition_interval: Literal["day", "hour"] = "day"
    retention: float | None = 7 * 86400.0
    dead_retention: float | None = 30 * 86400.0
    archive_to: str | None = None
    maintenance_interval: float = 300.0

    # connections
    reconnect_initial: float = 0.25
    reconnect_max: float = 2.0
    fail_fast: bool = False
    heartbeat: float = 5.0
    blocked_connection_timeout: float = 30.0

    def __post_init__(self) -> None:
        validate_identifier(self.schema)
        for name in ("db_url", "listen_url"):
            if url := getattr(self, name):
                object.__setattr__(self, name, validate_db_url(url))
        threshold = self.prepare_threshold
        if threshold not in (None, "auto") and not (_whole(threshold) and threshold >= 0):
            raise ConfigurationError(
                f'prepare_threshold must be "auto", None or a whole number >= 0, '
                f"got {self.prepare_threshold!r}"
            )
        if isinstance(self.mq_url, list | tuple):
            # Several nodes given as a list: the comma-separated form `broker_urls` reads.
            object.__setattr__(self, "mq_url", ",".join(str(u).strip() for u in self.mq_url))
        if self.mq_url:
            broker_urls(self.mq_url)  # raises ConfigurationError unless AMQP URLs
        for f in fields(self):
            value = getattr(self, f.name)
            number = _whole(value) or isinstance(value, float)
            # prepare_threshold 0 is valid: prepare at once
            if number and value <= 0 and f.name != "prepare_threshold":
                raise ConfigurationError(f"{f.name} must be > 0, got {value!r}")
        if self.processes is not None and not _whole(self.processes):
            raise ConfigurationError(
                f"processes must be None or a whole number >= 1, got {self.processes!r}"
            )
        if not isinstance(self.tenant_weights, Mapping) or not all(
            isinstance(t, str) and _whole(w) and w >= 1 for t, w in self.tenant_weights.items()
        ):
            raise ConfigurationError("tenant_weights must map tenants to whole numbers >= 1")
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))
        if not all(_whole(n) and n > 0 for n in dict(self.claim_check_types).values()):
            raise ConfigurationError("claim_check_types must map types to whole numbers > 0")
        object.__setattr__(self, "payload_sources", tuple(self.payload_sources))
        object.__setattr__(self, "webhooks", tuple(self.webhooks))
        if len({w.name for w in self.webhooks}) < len(self.webhooks):
            raise ConfigurationError("webhooks must have distinct names")
        object.__setattr__(self, "webhook_schedule", tuple(map(float, self.webhook_schedule)))
        if any(not 0 <= t < float("inf") for t in self.webhook_schedule):
            raise ConfigurationError("webhook_schedule must be seconds >= 0")
        if getattr(self.payload_store, "db_url", "") is None and self.db_url:  # the service's
            store = replace(self.payload_store, db_url=self.db_url, schema=self.schema)  # type: ignore[type-var]
            object.__setattr__(self, "payload_store", store)
        if self.publish_window > self.relay_batch_size:
            object.__setattr__(self, "publish_window", self.relay_batch_size)
        if not _whole(self.max_message_bytes):
            raise ConfigurationError(
                f"max_message_bytes must be a whole number of bytes, got {self.max_message_bytes!r}"
            )
        if self.receive_batch_size > self.prefetch:
            raise ConfigurationError("receive_batch_size must not exceed prefetch")
        if not all(isinstance(p, RetryPolicy) for p in (self.retry, self.receive_retry)):
            raise ConfigurationError("retry and receive_retry must be RetryPolicy objects")
        tiers = tuple(float(t) for t in self.delay_tiers)
        if not tiers or any(t <= 0 for t in tiers) or list(tiers) != sorted(set(tiers)):
            raise ConfigurationError("delay_tiers must be positive seconds in increasing order")
        object.__setattr__(self, "delay_tiers", tiers)
        if self.queue_type not in ("classic", "quorum"):
            raise ConfigurationError("queue_type must be 'classic' or 'quorum'")
        if self.delivery_limit is not None and self.queue_type != "quorum":
            raise ConfigurationError("delivery_limit needs queue_type='quorum'")
        if self.max_priority is not None:
            if self.queue_type == "quorum":
                raise ConfigurationError("max_priority needs a classic queue")
            if not 1 <= self.max_priority <= 255:
                raise ConfigurationError("max_priority must be in 1..255")
        if self.partition_interval not in ("day", "hour"):
            raise ConfigurationError(
                f'partition_interval must be "day" or "hour", got {self.partition_interval!r}'
            )
        self._check_duplicate_window()

    def _check_duplicate_window(self) -> None:
        """Refuse a retention shorter than the longest way a copy of a message can still
        arrive after its first copy was stored (duplicate_horizon)."""
        if self.retention is None:
            return
        paths = duplicate_horizon(self)
        horizon = sum(paths.values())
        if self.retention < horizon:
            spelled = " + ".join(f"{name} {_duration(sec)}" for name, sec in paths.items())
            raise ConfigurationError(
                f"retention {_duration(self.retention)} is shorter than the inbox's duplicate "
                f"window needs: a copy of a message can still arrive {_duration(horizon)} after "
                f"the first one ({spelled}); a shorter retention would store and handle it "
                "twice. Raise retention, or shorten receive_retry / relay_max_attempts * "
                "relay_retry_max"
            )

    def __repr__(self) -> str:
        # URLs carry passwords: shown masked, so a logged or printed Settings leaks none.
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            text = repr(mask_url(value)) if f.name.endswith("_url") and value else repr(value)
            shown.append(f"{f.name}={text}")
        return f"Settings({', '.join(shown)})"


def duplicate_horizon(settings: Settings) -> dict[str, float]:
    """The longest time, in seconds, after a message's first copy is stored by which another
    copy can still arrive without an operator, by path: the receiver's delay tiers (a copy that
    could not be stored comes back after them), and the relay's retries (a row published but
    not marked is published again)."""
    policy, tiers = settings.receive_retry, settings.delay_tiers
    receive, attempt = 0.0, 1
    while not policy.gives_up_after(attempt) and attempt < 10_000:
        wanted = min(policy.initial * policy.multiplier ** (attempt - 1), policy.max_interval)
        receive += next((t for t in tiers if t >= wanted), tiers[-1])
        attempt += 1
    relay = settings.relay_max_attempts * settings.relay_retry_max
    return {"receiver delay tiers": receive, "relay retries": relay}


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _duration(seconds: float) -> str:
    """Seconds as the largest whole units: 90061 -> '1d 1h 1m 1s'."""
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts) or "0s"
