"""The wire contract, written once: header names, where each identity field is read from on each
broker, how a delivery becomes a pginbox Message (and when it is bad input), how an effect becomes
a broker message, and what each SQLSTATE tells the consumer to do with the broker.

Publishers (the dispatcher's broker destinations) and readers (`pginbox consume`) use the same
names from here; docs/brokers.md has the tables.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pginbox.brokers.port import Delivery, Outgoing
from pginbox.client.outcomes import Message
from pginbox.client.retry import classify
from pginbox.errors import BadInput, ConsumerConfigError
from pginbox.sqlstates import condition
from pginbox.transports.effect import delivery_key

__all__ = [
    "BROKERS",
    "DEFAULT_SOURCES",
    "FENCED",
    "KAFKA",
    "MAX_JSON_DEPTH",
    "OFFSETS",
    "PRODUCED_AT_RANGE",
    "PROPERTIES",
    "Action",
    "BadInput",
    "Header",
    "IdentitySource",
    "action_for",
    "dead_letter_headers",
    "delivery_key",
    "identity_headers",
    "outgoing",
    "parse_message",
]


class Header:
    """Header names (stream field names, on Redis) of the wire contract."""

    PRODUCER: Final = "Pginbox-Producer"
    MESSAGE_ID: Final = "Pginbox-Message-Id"
    TYPE: Final = "Pginbox-Type"
    PRODUCED_AT: Final = "Pginbox-Produced-At"
    TENANT: Final = "Pginbox-Tenant"
    ORDERING_KEY: Final = "Pginbox-Ordering-Key"
    # on a dead letter
    SQLSTATE: Final = "Pginbox-Sqlstate"
    REASON: Final = "Pginbox-Reason"
    ORIGIN: Final = "Pginbox-Original"  # where it was read: subject, or stream and entry id
    # JetStream's own: the stream drops a message whose Nats-Msg-Id it saw within its window
    NATS_MSG_ID: Final = "Nats-Msg-Id"
    # Redis: the field holding the body
    BODY: Final = "body"


RABBITMQ: Final = "rabbitmq"
NATS: Final = "nats"
REDIS: Final = "redis"
KAFKA: Final = "kafka"
MEMORY: Final = "memory"
BROKERS: Final = (RABBITMQ, NATS, REDIS, KAFKA, MEMORY)
#: SQLSTATE of inbox.kafka_store_offsets when the partition was assigned again meanwhile: the
#: batch's transaction rolled back, and the adapter must acquire the partition again.
FENCED: Final = "IRK01"

#: Broker properties an identity field may be read from (besides header:NAME and const:VALUE).
PROPERTIES: Final[Mapping[str, frozenset[str]]] = {
    RABBITMQ: frozenset(
        {
            "app_id",
            "message_id",
            "type",
            "timestamp",
            "correlation_id",
            "user_id",
            "routing_key",
            "exchange",
            "content_type",
            "reply_to",
        }
    ),
    NATS: frozenset({"subject", "stream", "sequence", "timestamp"}),
    REDIS: frozenset({"stream"}),
    # create_time: the record's CreateTime (None when the topic stamps LogAppendTime);
    # log_append_time: the broker's append time (None under CreateTime); position: "topic:partition:offset",
    # the explicit opt-in for topics whose producers write no id (docs/kafka.md)
    KAFKA: frozenset({"topic", "partition", "offset", "key", "create_time", "log_append_time", "position"}),
    MEMORY: frozenset({"queue"}),
}
#: Properties that are positions in a log, not identities: a message published again gets a new
#: one, so they can never be its message id (Redis entry ids are not even offered).
OFFSETS: Final[Mapping[str, frozenset[str]]] = {NATS: frozenset({"sequence"}), KAFKA: frozenset({"offset"})}

_HEADERS_SOURCES: Final = {
    "producer": f"header:{Header.PRODUCER}",
    "message_id": f"header:{Header.MESSAGE_ID}",
    "message_type": f"header:{Header.TYPE}",
    "produced_at": f"header:{Header.PRODUCED_AT}",
    "tenant": f"header:{Header.TENANT}",
}
#: Where each identity field is read by default: what pginbox's own destinations write.
DEFAULT_SOURCES: Final[Mapping[str, Mapping[str, str]]] = {
    RABBITMQ: {
        "producer": "app_id",
        "message_id": "message_id",
        "message_type": "type",
        "produced_at": "timestamp",
        "tenant": f"header:{Header.TENANT}",
    },
    # Nats-Msg-Id as the fallback: what pginbox 0.2 destinations wrote as the id
    NATS: {**_HEADERS_SOURCES, "message_id": f"header:{Header.MESSAGE_ID}|header:{Header.NATS_MSG_ID}"},
    REDIS: _HEADERS_SOURCES,
    KAFKA: {**_HEADERS_SOURCES, "produced_at": f"header:{Header.PRODUCED_AT}|create_time"},
    MEMORY: _HEADERS_SOURCES,
}
IDENTITY_FIELDS: Final = ("producer", "message_id", "message_type", "produced_at", "tenant")

#: produced_at outside [low, high) is refused (22008), never reinterpreted: AMQP timestamps past
#: 2106 come out of the client library as 1970 (read as milliseconds), and a year-1970 message
#: would be taken for one older than every purge ("expired").
PRODUCED_AT_RANGE: Final = (
    datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC),
    datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC),
)
#: Deeper JSON is refused (22P02): the consumer's JSON encoder and decoder recurse.
MAX_JSON_DEPTH: Final = 200


@dataclass(frozen=True)
class IdentitySource:
    """Where one identity field is read from: a broker property, a header (a stream field on
    Redis; `field:NAME` is the same), or a constant; `fallback` when the first has no value
    (`header:A|header:B`)."""

    kind: str  # "property" | "header" | "const"
    name: str
    fallback: IdentitySource | None = None

    @classmethod
    def parse(cls, spec: str, setting: str, broker: str) -> IdentitySource:
        first, bar, rest = spec.partition("|")
        fallback = cls.parse(rest, setting, broker) if bar else None
        kind, sep, value = first.partition(":")
        if sep and kind in ("header", "field"):
            if not value:
                raise ConsumerConfigError(f"consume setting {setting}: '{kind}:' needs a name")
            return cls("header", value, fallback)
        if sep and kind == "const":
            return cls("const", value, fallback)
        if first in PROPERTIES[broker]:
            if setting == "message_id" and first in OFFSETS.get(broker, ()):
                raise ConsumerConfigError(
                    f"consume setting message_id={first!r}: a {broker} {first} is a position in the stream, not "
                    "the message's identity (a message published again gets a new one): read the id from a header"
                    + (
                        ", or opt in with message_id = 'position' (docs/kafka.md: only for topics whose producers "
                        "never write a record twice)"
                        if broker == KAFKA
                        else ""
                    )
                )
            return cls("property", first, fallback)
        raise ConsumerConfigError(
            f"consume setting {setting}={spec!r}: expected one of {sorted(PROPERTIES[broker])} (a {broker} "
            "message property), 'header:NAME' or 'const:VALUE'"
        )

    def describe(self) -> str:
        here = self.name if self.kind == "property" else f"{self.kind} {self.name}"
        return here if self.fallback is None else f"{here}, else {self.fallback.describe()}"

    def read(self, delivery: Delivery) -> Any:
        if self.kind == "const":
            value: Any = self.name
        elif self.kind == "header":
            wanted = self.name.lower()
            value = next((v for k, v in delivery.headers.items() if str(k).lower() == wanted), None)
        else:
            value = delivery.properties.get(self.name)
        if (value is None or value == "" or value == b"") and self.fallback is not None:
            return self.fallback.read(delivery)
        return value


def _text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput("22021", f"the {name} is not valid UTF-8") from None
    elif isinstance(value, bool) or not isinstance(value, str | int):
        raise BadInput("22023", f"the {name} is a {type(value).__name__}, not text")
    text = str(value)
    if "\x00" in text:
        raise BadInput("22021", f"the {name} contains a NUL character")
    return text or None


def _timestamp(value: Any, source: IdentitySource) -> datetime.datetime | None:
    if value is None or value == "" or value == b"":
        return None
    if isinstance(value, datetime.datetime):
        parsed = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            parsed = datetime.datetime.fromtimestamp(float(value), datetime.UTC)
        except (OverflowError, OSError, ValueError):
            parsed = datetime.datetime.max.replace(tzinfo=datetime.UTC)
    else:
        text = _text(value, "produced_at") or ""
        try:
            parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise BadInput(
                "22007", f"produced_at {text[:64]!r} (from {source.describe()}) is not an ISO 8601 timestamp"
            ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    low, high = PRODUCED_AT_RANGE
    if not low <= parsed < high:
        raise BadInput(
            "22008",
            f"produced_at {parsed.isoformat()} (from {source.describe()}) is outside "
            f"{low.year}..{high.year}: refused, not reinterpreted",
        )
    return parsed


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _deeper_than(value: Any, limit: int) -> bool:
    """True when `value` nests more than `limit` arrays or objects (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def parse_body(body: bytes) -> Any:
    """The JSON payload of a body, or BadInput 22P02 (not JSON, NaN/Infinity, nested deeper than
    MAX_JSON_DEPTH; a body nested 100,000 deep is refused, never a RecursionError)."""
    try:
        payload = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadInput("22P02", f"the body is JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput("22P02", f"the body is not JSON: {str(exc)[:200]}") from None
    # Bracket count first (C speed): only a body with many brackets is walked.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _deeper_than(payload, MAX_JSON_DEPTH):
        raise BadInput("22P02", f"the body is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return payload


def parse_message(delivery: Delivery, sources: Mapping[str, IdentitySource]) -> Message:
    """The pginbox Message of a delivery, or BadInput."""
    values: dict[str, str] = {}
    for name in ("producer", "message_id", "message_type"):
        source = sources[name]
        text = _text(source.read(delivery), name)
        if text is None:
            raise BadInput("22004", f"the message has no {name} (read from {source.describe()})")
        values[name] = text
    return Message(
        producer=values["producer"],
        message_id=values["message_id"],
        message_type=values["message_type"],
        payload=parse_body(delivery.body),
        tenant=_text(sources["tenant"].read(delivery), "tenant") or "",
        produced_at=_timestamp(sources["produced_at"].read(delivery), sources["produced_at"]),
        redelivered=delivery.redelivered,
    )


# ----------------------------------------------------------------------------- errors


class Action(enum.Enum):
    """What the consumer does with the broker when a call raised an error instead of a result."""

    RETRY = "retry"  # transient: re-run the transaction; still failing: hand back, pause
    DEAD_LETTER = "dead_letter"  # the message can never be accepted as it is
    HALT = "halt"  # configuration or rights: every message would fail the same way


def action_for(exc: BaseException) -> Action:
    """By pginbox.sqlstates: transient (class 40, 08, 53, 57, 55P03, no answer): RETRY. Bad input
    (class 22 and 54: bad values, sizes, depth), and a value the driver could not send:
    DEAD_LETTER. Anything else (42501 not bound, 42704 nobody bound / no handler, 42883 a dropped
    handler, 42P01, 3F000 ...): HALT — dead-lettering would empty the queue into the dead letter."""
    if classify(exc) is not None:
        return Action.RETRY
    state = getattr(exc, "sqlstate", None)
    if state is None:
        # psycopg refused to send a value (a NUL in text): the message's, not the database's
        return Action.DEAD_LETTER if type(exc).__name__ == "DataError" else Action.RETRY
    if condition(state).bad_input:
        return Action.DEAD_LETTER
    return Action.HALT


# ----------------------------------------------------------------------------- publishing


def outgoing(effect: Any, *, producer: str, message_type: str | None = None, destination: str = "") -> Outgoing:
    """An effect as a broker message. The type: the effect's Pginbox-Type header, else
    `message_type`, else the destination's name; produced_at: when the effect was created."""
    headers = {str(k): str(v) for k, v in dict(effect.headers or {}).items()}
    body = json.dumps(effect.payload, separators=(",", ":"), ensure_ascii=False).encode()
    key = delivery_key(effect)
    created = getattr(effect, "created_at", None)
    if not isinstance(created, datetime.datetime):
        created = datetime.datetime.now(datetime.UTC)
    ordering = getattr(effect, "ordering_key", None)
    return Outgoing(
        body=body,
        message_id=key,
        dedup_id=f"{key}:{hashlib.sha256(body).hexdigest()}",
        producer=producer,
        message_type=headers.get(Header.TYPE) or message_type or destination or "effect",
        produced_at=created,
        headers=headers,
        ordering_key=str(ordering) if ordering else None,
    )


def identity_headers(message: Outgoing) -> dict[str, str]:
    """The message's headers with the identity written as the Pginbox-* headers (JetStream, Redis
    fields, the in-memory broker; RabbitMQ uses its properties instead)."""
    headers = dict(message.headers)
    headers.update(
        {
            Header.MESSAGE_ID: message.message_id,
            Header.PRODUCER: message.producer,
            Header.TYPE: message.message_type,
            Header.PRODUCED_AT: message.produced_at.isoformat(),
        }
    )
    if message.ordering_key:
        headers[Header.ORDERING_KEY] = message.ordering_key
    return headers


def dead_letter_headers(sqlstate: str, reason: str, origin: str) -> dict[str, str]:
    """What a dead letter carries besides the original's headers (the reason on one line)."""
    one_line = " ".join(reason.split())[:1000]
    return {Header.SQLSTATE: sqlstate, Header.REASON: one_line, Header.ORIGIN: origin}
