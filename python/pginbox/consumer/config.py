"""`ConsumeConfig`: what `pginbox consume` reads, and where from.

Precedence: command-line option > PGINBOX_CONSUME_<OPTION> environment variable > the [consume]
table of the TOML file (--config) > the defaults below. Every key of the table is also an option
(`message_id` is `--message-id`, read from PGINBOX_CONSUME_MESSAGE_ID).

    [consume]
    url = "amqp://guest:guest@127.0.0.1:5672/"   # amqp(s)://: RabbitMQ, nats://: NATS JetStream,
                                         # redis(s)://: Redis Streams, memory://NAME: in-process
    consumer = "billing"                 # the pginbox consumer name (part of every identity)
    queue = "billing"                    # RabbitMQ (and memory): the queue consumed (declared durable if missing)
    stream = "ORDERS"                    # NATS: the stream; Redis: the stream key ...
    subject = "orders.>"                 # ... NATS: the filter subject of the durable pull consumer,
    durable = "billing"                  # ... the durable name / Redis consumer group [default: the consumer name]
    claim_idle = 30.0                    # NATS ack_wait / Redis: idle seconds before XAUTOCLAIM takes an entry over
    consumer_name = "host-1"             # Redis: this process's name in the group [default: host-pid-random]
    handler = "sql"                      # SQL handlers (inbox.register_handler), or "module:function"
    handler_version = "v1"               # recorded by Python handlers [default: unversioned]
    prefetch = 50                        # messages claimed per transaction (1..64)
    retry_delay = 1.0                    # first delay of a FAILED message, seconds, doubled ...
    max_retry_delay = 300.0              # ... up to this
    dead_letter = "billing.dead"         # RabbitMQ queue / NATS subject / Redis stream [default:
                                         #   <queue>.dead, pginbox.dead.<durable>, <stream>:dead]
    # Identity: a broker property, "header:NAME" (a field, on Redis) or "const:VALUE"; "a|b" reads b
    # when a is missing (defaults: what pginbox's own destinations write; docs/brokers.md)
    producer = "app_id"
    message_id = "message_id"
    message_type = "type"
    produced_at = "timestamp"
    tenant = "header:Pginbox-Tenant"
    # When a batch is acked (docs/failover.md): "commit" (after COMMIT on the primary, the default)
    # or "standby" (once min_standbys of standby_names [default: any] flushed -- or applied -- it)
    durability = "standby"
    min_standbys = 1
    standby_names = ["pg2"]              # a TOML list, or names separated by commas
    standby_wait = "flush"               # or "apply"
    durability_timeout = 10.0            # seconds; then the batch is handed back, never acked
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pginbox.brokers.port import SourceConfig
from pginbox.brokers.wire import (
    BROKERS,
    DEFAULT_SOURCES,
    IDENTITY_FIELDS,
    KAFKA,
    MEMORY,
    NATS,
    RABBITMQ,
    REDIS,
    IdentitySource,
)
from pginbox.client.durability import Durability
from pginbox.errors import ConsumerConfigError
from pginbox.runtime.log import safe_url
from pginbox.sql_limits import MAX_BATCH

__all__ = ["DEFAULT_SOURCES", "ConsumeConfig", "IdentitySource", "broker_of", "load_consume_config", "safe_url"]


def broker_of(url: str) -> str:
    scheme = url.partition("://")[0].lower()
    if scheme in ("amqp", "amqps"):
        return RABBITMQ
    if scheme in ("nats", "tls", "nats+tls"):
        return NATS
    if scheme in ("redis", "rediss", "unix"):
        return REDIS
    if scheme == KAFKA:
        return KAFKA
    if scheme == MEMORY:
        return MEMORY
    raise ConsumerConfigError(
        f"consume url {safe_url(url)!r}: expected amqp(s)://... (RabbitMQ), nats://... (NATS JetStream), "
        "redis(s)://... (Redis Streams), kafka://host:port[,host:port] (Kafka) or memory://NAME"
    )


@dataclass(frozen=True)
class ConsumeConfig:
    url: str
    consumer: str
    broker: str = RABBITMQ
    queue: str | None = None
    stream: str | None = None
    subject: str | None = None
    durable: str | None = None
    topic: str | None = None
    offset_reset: str = "earliest"
    handler: str = "sql"
    handler_version: str = "unversioned"
    prefetch: int = 50
    retry_delay: float = 1.0
    max_retry_delay: float = 300.0
    dead_letter: str | None = None
    sources: Mapping[str, IdentitySource] = field(default_factory=dict)
    declare: bool = True
    claim_idle: float = 30.0
    consumer_name: str | None = None
    health_port: int | None = None
    health_host: str = "127.0.0.1"
    durability: Durability = field(default_factory=Durability)

    @property
    def source_name(self) -> str:
        """The queue, or stream/durable (Kafka: topic/group), for logs."""
        return self.queue or f"{self.topic or self.stream}/{self.durable}"

    @property
    def dead_letter_target(self) -> str:
        if self.dead_letter:
            return self.dead_letter
        if self.broker in (RABBITMQ, MEMORY):
            return f"{self.queue}.dead"
        if self.broker == REDIS:
            return f"{self.stream}:dead"
        if self.broker == KAFKA:
            return f"{self.topic}.dead"
        return f"pginbox.dead.{self.durable}"

    @property
    def source(self) -> SourceConfig:
        """What the broker adapter is told (pginbox.brokers.port.SourceConfig)."""
        options: dict[str, Any] = {"consumer_name": self.consumer_name} if self.consumer_name else {}
        if self.broker == KAFKA:
            options["offset_reset"] = self.offset_reset
        return SourceConfig(
            broker=self.broker,
            url=self.url,
            consumer=self.consumer,
            dead_letter=self.dead_letter_target,
            prefetch=self.prefetch,
            queue=self.queue,
            stream=self.topic or self.stream,
            subject=self.subject,
            durable=self.durable,
            declare=self.declare,
            claim_idle=self.claim_idle,
            options=options,
        )


_DURABILITY_KEYS = frozenset({"min_standbys", "standby_names", "standby_wait", "durability_timeout"})
_KEYS = (
    frozenset({f.name for f in fields(ConsumeConfig)} - {"sources", "broker"})
    | set(IDENTITY_FIELDS)
    | {"broker"}
    | _DURABILITY_KEYS
)


def _durability(table: Mapping[str, Any]) -> Durability:
    mode = str(table.get("durability", "commit"))
    if mode not in ("commit", "standby"):
        raise ConsumerConfigError(f"consume setting durability={mode!r}: expected 'commit' or 'standby'")
    if mode == "commit":
        given = sorted(k for k in _DURABILITY_KEYS if table.get(k) is not None)
        if given:
            raise ConsumerConfigError(
                f"consume settings {given} apply to durability 'standby' only: set durability = \"standby\" "
                "or remove them"
            )
        return Durability()
    raw_names = table.get("standby_names")
    names: tuple[str, ...] | None = None
    if raw_names is not None:
        items = raw_names.split(",") if isinstance(raw_names, str) else raw_names
        if not isinstance(items, list | tuple) or not all(isinstance(n, str) and n.strip() for n in items) or not items:
            raise ConsumerConfigError(
                f"consume setting standby_names={raw_names!r}: expected standby application names "
                "(a list, or separated by commas)"
            )
        names = tuple(n.strip() for n in items)
    wait = str(table.get("standby_wait", "flush"))
    if wait not in ("flush", "apply"):
        raise ConsumerConfigError(f"consume setting standby_wait={wait!r}: expected 'flush' or 'apply'")
    return Durability.standby(
        _number(table.get("min_standbys", 1), "min_standbys", int, 1, 64),
        names=names,
        wait="apply" if wait == "apply" else "flush",
        timeout=_number(table.get("durability_timeout", 10.0), "durability_timeout", float, 0, 3600),
    )


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
    if broker not in BROKERS:
        raise ConsumerConfigError(f"consume setting broker={broker!r}: expected one of {list(BROKERS)}")
    consumer = table.get("consumer")
    if not consumer:
        raise ConsumerConfigError(
            "consume: no pginbox consumer name: pass --consumer, set PGINBOX_CONSUME_CONSUMER or consumer in [consume]"
        )
    config = ConsumeConfig(url=str(url), consumer=str(consumer), broker=broker)
    if broker in (RABBITMQ, MEMORY):
        if not table.get("queue"):
            raise ConsumerConfigError(
                f"consume: {'RabbitMQ' if broker == RABBITMQ else 'memory://'} needs a queue: "
                "pass --queue or set queue in [consume]"
            )
        config = replace(config, queue=str(table["queue"]))
    elif broker == KAFKA:
        if not table.get("topic"):
            raise ConsumerConfigError("consume: Kafka needs a topic: pass --topic or set topic in [consume]")
        reset = str(table.get("offset_reset", "earliest"))
        if reset not in ("earliest", "latest"):
            raise ConsumerConfigError(f"consume setting offset_reset={reset!r}: expected 'earliest' or 'latest'")
        config = replace(
            config, topic=str(table["topic"]), durable=str(table.get("durable") or consumer), offset_reset=reset
        )
    else:
        if not table.get("stream"):
            what = "NATS JetStream" if broker == NATS else "Redis Streams"
            raise ConsumerConfigError(f"consume: {what} needs a stream: pass --stream or set stream in [consume]")
        config = replace(
            config,
            stream=str(table["stream"]),
            subject=table.get("subject") and str(table["subject"]),
            durable=str(table.get("durable") or consumer),
        )
    sources = {
        name: IdentitySource.parse(str(table.get(name, DEFAULT_SOURCES[broker][name])), name, broker)
        for name in IDENTITY_FIELDS
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
        claim_idle=_number(table.get("claim_idle", 30.0), "claim_idle", float, 0.05),
        consumer_name=table.get("consumer_name") and str(table["consumer_name"]),
        health_port=None if health_port is None else _number(health_port, "health_port", int, 0, 65535),
        health_host=str(table.get("health_host", "127.0.0.1")),
        durability=_durability(table),
    )
