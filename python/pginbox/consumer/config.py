"""`ConsumeConfig`: what `pginbox consume` reads, and where from.

Precedence: command-line option > PGINBOX_CONSUME_<OPTION> environment variable > the [consume]
table of the TOML file (--config) > the defaults below. Every key of the table is also an option
(`message_id` is `--message-id`, read from PGINBOX_CONSUME_MESSAGE_ID).

    [consume]
    url = "amqp://guest:guest@127.0.0.1:5672/"   # amqp(s)://: RabbitMQ, nats(s)://: NATS JetStream
    consumer = "billing"                 # the pginbox consumer name (part of every identity)
    queue = "billing"                    # RabbitMQ: the queue consumed (declared durable if missing)
    stream = "ORDERS"                    # NATS: the stream, ...
    subject = "orders.>"                 # ... the filter subject of the durable pull consumer,
    durable = "billing"                  # ... and its durable name [default: the consumer name]
    handler = "sql"                      # SQL handlers (inbox.register_handler), or "module:function"
    handler_version = "v1"               # recorded by Python handlers [default: unversioned]
    prefetch = 50                        # messages claimed per transaction (1..64)
    retry_delay = 1.0                    # first delay of a FAILED message, seconds, doubled ...
    max_retry_delay = 300.0              # ... up to this
    dead_letter = "billing.dead"         # RabbitMQ queue / NATS subject [default: <queue>.dead,
                                         #   NATS: pginbox.dead.<durable>]
    # Identity: a broker property, "header:NAME" or "const:VALUE" (defaults: what pginbox's own
    # broker destinations write; see docs/brokers.md)
    producer = "app_id"
    message_id = "message_id"
    message_type = "type"
    produced_at = "timestamp"
    tenant = "const:"
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from pginbox.errors import ConsumerConfigError
from pginbox.sql_limits import MAX_BATCH

__all__ = ["DEFAULT_SOURCES", "ConsumeConfig", "IdentitySource", "broker_of", "load_consume_config", "safe_url"]

RABBITMQ: Final = "rabbitmq"
NATS: Final = "nats"

#: What pginbox's own destinations write, per broker (transports/rabbitmq.py, transports/jetstream.py).
DEFAULT_SOURCES: Final[Mapping[str, Mapping[str, str]]] = {
    RABBITMQ: {
        "producer": "app_id",
        "message_id": "message_id",
        "message_type": "type",
        "produced_at": "timestamp",
        "tenant": "header:Pginbox-Tenant",
    },
    NATS: {
        "producer": "header:Pginbox-Producer",
        "message_id": "header:Nats-Msg-Id",
        "message_type": "header:Pginbox-Type",
        "produced_at": "header:Pginbox-Produced-At",
        "tenant": "header:Pginbox-Tenant",
    },
}

_PROPERTIES: Final[Mapping[str, frozenset[str]]] = {
    RABBITMQ: frozenset({"app_id", "message_id", "type", "timestamp", "correlation_id", "user_id",
                         "routing_key", "exchange", "content_type", "reply_to"}),
    NATS: frozenset({"subject", "stream", "sequence", "timestamp"}),
}


@dataclass(frozen=True)
class IdentitySource:
    """Where one identity field is read from: a broker property, a header, or a constant."""

    kind: str  # "property" | "header" | "const"
    name: str

    @classmethod
    def parse(cls, spec: str, setting: str, broker: str) -> IdentitySource:
        kind, sep, rest = spec.partition(":")
        if sep and kind == "header":
            if not rest:
                raise ConsumerConfigError(f"consume setting {setting}: 'header:' needs a header name")
            return cls("header", rest)
        if sep and kind == "const":
            return cls("const", rest)
        if spec in _PROPERTIES[broker]:
            return cls("property", spec)
        raise ConsumerConfigError(
            f"consume setting {setting}={spec!r}: expected one of {sorted(_PROPERTIES[broker])} (a {broker} "
            "message property), 'header:NAME' or 'const:VALUE'"
        )


def safe_url(url: str) -> str:
    """The broker URL without its user and password, for messages and logs: what stands before the
    last '@' of the host part goes (an '@' in the path or query stays)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{tail}"


def broker_of(url: str) -> str:
    scheme = url.partition("://")[0].lower()
    if scheme in ("amqp", "amqps"):
        return RABBITMQ
    if scheme in ("nats", "tls", "nats+tls"):
        return NATS
    raise ConsumerConfigError(
        f"consume url {safe_url(url)!r}: expected amqp(s)://... (RabbitMQ) or nats://... (NATS JetStream)")


@dataclass(frozen=True)
class ConsumeConfig:
    url: str
    consumer: str
    broker: str = RABBITMQ
    queue: str | None = None
    stream: str | None = None
    subject: str | None = None
    durable: str | None = None
    handler: str = "sql"
    handler_version: str = "unversioned"
    prefetch: int = 50
    retry_delay: float = 1.0
    max_retry_delay: float = 300.0
    dead_letter: str | None = None
    sources: Mapping[str, IdentitySource] = field(default_factory=dict)
    declare: bool = True
    health_port: int | None = None
    health_host: str = "127.0.0.1"

    @property
    def source_name(self) -> str:
        """The queue, or stream/durable, for logs."""
        return self.queue or f"{self.stream}/{self.durable}"

    @property
    def dead_letter_target(self) -> str:
        if self.dead_letter:
            return self.dead_letter
        if self.broker == RABBITMQ:
            return f"{self.queue}.dead"
        return f"pginbox.dead.{self.durable}"


_IDENTITY = ("producer", "message_id", "message_type", "produced_at", "tenant")
_KEYS = frozenset({f.name for f in fields(ConsumeConfig)} - {"sources", "broker"}) | set(_IDENTITY) | {"broker"}


def _number(value: Any, setting: str, kind: type[int] | type[float], low: float, high: float | None = None) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConsumerConfigError(f"consume setting {setting}={value!r}: expected a number") from None
    if number < low or (high is not None and number > high):
        bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise ConsumerConfigError(f"consume setting {setting}={value!r}: must be {bound}")
    return number


def load_consume_config(
    path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None
) -> ConsumeConfig:
    """The [consume] table of `path` (if any), with `overrides` (options and their environment
    variables, None meaning "not given") on top. Raises ConsumerConfigError naming what to fix."""
    table: dict[str, Any] = {}
    if path is not None:
        try:
            with Path(path).open("rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConsumerConfigError(f"{path}: {exc}") from None
        raw = doc.get("consume", {})
        if not isinstance(raw, dict):
            raise ConsumerConfigError(f"{path}: [consume] must be a table")
        unknown = set(raw) - _KEYS
        if unknown:
            raise ConsumerConfigError(f"{path}: unknown [consume] key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
        table.update(raw)
    for key, value in (overrides or {}).items():
        if value is not None:
            table[key] = value
    url = table.get("url")
    if not url:
        raise ConsumerConfigError("consume: no broker url: pass --url, set PGINBOX_CONSUME_URL or url in [consume]")
    broker = str(table.get("broker") or broker_of(str(url)))
    if broker not in (RABBITMQ, NATS):
        raise ConsumerConfigError(f"consume setting broker={broker!r}: expected 'rabbitmq' or 'nats'")
    consumer = table.get("consumer")
    if not consumer:
        raise ConsumerConfigError(
            "consume: no pginbox consumer name: pass --consumer, set PGINBOX_CONSUME_CONSUMER or consumer in [consume]"
        )
    config = ConsumeConfig(url=str(url), consumer=str(consumer), broker=broker)
    if broker == RABBITMQ:
        if not table.get("queue"):
            raise ConsumerConfigError("consume: RabbitMQ needs a queue: pass --queue or set queue in [consume]")
        config = replace(config, queue=str(table["queue"]))
    else:
        if not table.get("stream"):
            raise ConsumerConfigError(
                "consume: NATS JetStream needs a stream: pass --stream or set stream in [consume]"
            )
        config = replace(config, stream=str(table["stream"]), subject=table.get("subject") and str(table["subject"]),
                         durable=str(table.get("durable") or consumer))
    sources = {
        name: IdentitySource.parse(str(table.get(name, DEFAULT_SOURCES[broker][name])), name, broker)
        for name in _IDENTITY
    }
    retry_delay = _number(table.get("retry_delay", 1.0), "retry_delay", float, 0.001)
    max_retry_delay = _number(table.get("max_retry_delay", 300.0), "max_retry_delay", float, retry_delay)
    health_port = table.get("health_port")
    return replace(
        config,
        handler=str(table.get("handler", "sql")),
        handler_version=str(table.get("handler_version", "unversioned")),
        prefetch=_number(table.get("prefetch", 50), "prefetch", int, 1, MAX_BATCH),
        retry_delay=retry_delay,
        max_retry_delay=max_retry_delay,
        dead_letter=table.get("dead_letter") and str(table["dead_letter"]),
        sources=sources,
        declare=bool(table.get("declare", True)),
        health_port=None if health_port is None else _number(health_port, "health_port", int, 0, 65535),
        health_host=str(table.get("health_host", "127.0.0.1")),
    )
