"""Destinations by name: `load_config`.

Configuration (load_config)
  TOML file:

      [destinations.billing]
      url = "https://billing.example.com/hooks/outbox"
      method = "POST"                         # default POST
      headers = { Authorization = "Bearer s3cr3t", X-Tenant = "acme" }
      forward_on_redirect = ["X-Tenant"]      # configured headers kept on a cross-origin redirect
      timeout = 10.0                          # seconds, every phase (connect, write, read)
      allow_hosts = ["10.1.2.0/24", "hooks.internal"]   # SSRF allowlist: host names, IPs, CIDRs
      retry_on = [408, 429, "500-599"]        # statuses (or "lo-hi" ranges) that are retryable

      [destinations.audit]                    # no url: options for the entry point `audit`
      level = "info"

  Environment (wins over the file), <NAME> = destination name upper-cased, non-alphanumerics -> _:
      PGINBOX_DEST_<NAME>_URL, _METHOD, _TIMEOUT,
      _HEADERS      (JSON object, merged over the file's headers)
      _ALLOW_HOSTS  (comma-separated), _RETRY_ON (comma-separated, e.g. "429,500-599"),
      _FORWARD_ON_REDIRECT (comma-separated header names)
  A PGINBOX_DEST_<NAME>_URL without a section in the file defines the destination `<name>`
  (lower-cased).

  Message brokers and callables (`type` is inferred from the URL scheme, or from `callable` /
  `factory`, when it is left out):

      [destinations.orders]                   # RabbitMQ: pginbox.brokers.rabbitmq
      type = "rabbitmq"
      url = "amqp://guest:guest@127.0.0.1:5672/"
      routing_key = "orders"                  # the queue, with the default exchange
      exchange = ""                           # or a named exchange
      ordering_key = "header"                 # or "routing_key"
      producer = "shop"                       # app_id; message_type = "..." (default: the name)
      timeout = 10.0

      [destinations.events]                   # NATS JetStream: pginbox.brokers.jetstream
      url = "nats://127.0.0.1:4222"
      subject = "shop.events"
      producer = "shop"

      [destinations.feed]                     # Redis Streams: pginbox.brokers.redis
      url = "redis://127.0.0.1:6379/0"
      stream = "shop.feed"
      maxlen = 1000000                        # XADD ... MAXLEN ~ (optional)
      producer = "shop"

      [destinations.shipments]                # Kafka: pginbox.brokers.kafka (acks=all, the
      url = "kafka://127.0.0.1:9092"          #   ordering key as the record key)
      topic = "shop.shipments"
      producer = "shop"

      [destinations.audit]                    # a Python callable, without an entry point
      callable = "myapp.outbox:send_audit"    # fn(effect); or factory = "module:function",
                                              # called with the section's other keys

  Environment for these: PGINBOX_DEST_<NAME>_TYPE, _CALLABLE, _FACTORY, _ROUTING_KEY, _EXCHANGE,
  _SUBJECT, _STREAM, _MAXLEN, _PRODUCER, _MESSAGE_TYPE, _ORDERING_KEY (a _URL, _CALLABLE or _FACTORY variable alone
  defines the destination).

  Python callables: every entry point in the group `pginbox.destinations` is a destination whose
  name is the entry point name; it is loaded and called as `factory(**options)` (options: the TOML
  section of that name, {} when there is none) and must return a Transport (an object with
  `deliver(effect) -> DeliveryReport`), or a plain callable `fn(effect)` which is wrapped: it is
  delivered when it returns (or returns a DeliveryReport, used as is), ambiguous when it raises.

      # pyproject.toml of the package providing the destination
      [project.entry-points."pginbox.destinations"]
      audit = "myapp.outbox:make_audit_transport"
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from pginbox.runtime.loading import load_object
from pginbox.transports.callable import CallableTransport
from pginbox.transports.protocol import Transport
from pginbox.transports.webhook import DEFAULT_RETRY_ON, WebhookTransport, parse_retry_on

__all__ = [
    "ENTRY_POINT_GROUP",
    "destination_names",
    "destination_sections",
    "destination_type",
    "env_prefix",
    "find_entry_points",
    "load_config",
    "transport_from_options",
    "webhook_from_options",
]

ENTRY_POINT_GROUP = "pginbox.destinations"


def env_prefix(name: str) -> str:
    return "PGINBOX_DEST_" + "".join(c if c.isalnum() else "_" for c in name.upper()) + "_"


def _split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _apply_env(name: str, section: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    prefix = env_prefix(name)
    merged = dict(section)
    if (url := environ.get(prefix + "URL")) is not None:
        merged["url"] = url
    if (method := environ.get(prefix + "METHOD")) is not None:
        merged["method"] = method
    if (timeout := environ.get(prefix + "TIMEOUT")) is not None:
        merged["timeout"] = float(timeout)
    if (headers := environ.get(prefix + "HEADERS")) is not None:
        extra = json.loads(headers)
        if not isinstance(extra, dict):
            raise ValueError(f"{prefix}HEADERS must be a JSON object")
        merged["headers"] = {**dict(merged.get("headers") or {}), **extra}
    if (allow := environ.get(prefix + "ALLOW_HOSTS")) is not None:
        merged["allow_hosts"] = _split_list(allow)
    if (retry_on := environ.get(prefix + "RETRY_ON")) is not None:
        merged["retry_on"] = _split_list(retry_on)
    if (forward := environ.get(prefix + "FORWARD_ON_REDIRECT")) is not None:
        merged["forward_on_redirect"] = _split_list(forward)
    for key in _PLAIN_ENV_KEYS:
        if (value := environ.get(prefix + key.upper())) is not None:
            merged[key] = value
    return merged


_PLAIN_ENV_KEYS = (
    "type",
    "callable",
    "factory",
    "routing_key",
    "exchange",
    "subject",
    "stream",
    "maxlen",
    "producer",
    "message_type",
    "ordering_key",
    "topic",
)
_DEFINING_ENV = ("_URL", "_CALLABLE", "_FACTORY")
_TYPES = ("webhook", "rabbitmq", "nats", "redis", "kafka", "callable")


def destination_type(name: str, options: Mapping[str, Any]) -> str | None:
    """The destination's type: its `type`, else inferred (callable/factory, the URL scheme);
    None when there is nothing to infer it from (an entry point's options)."""
    kind = options.get("type")
    if kind is not None:
        if kind not in _TYPES:
            raise ValueError(f"destination {name!r}: type must be one of {list(_TYPES)}, got {kind!r}")
        return str(kind)
    if "callable" in options or "factory" in options:
        return "callable"
    url = options.get("url")
    if url is None:
        return None
    scheme = str(url).partition("://")[0].lower()
    if scheme in ("http", "https"):
        return "webhook"
    if scheme in ("amqp", "amqps"):
        return "rabbitmq"
    if scheme in ("nats", "tls"):
        return "nats"
    if scheme in ("redis", "rediss", "unix"):
        return "redis"
    if scheme == "kafka":
        return "kafka"
    raise ValueError(
        f"destination {name!r}: cannot tell the type from url scheme {scheme!r}: set type = "
        "'webhook', 'rabbitmq', 'nats', 'redis' or 'kafka'"
    )


def _import(name: str, key: str, spec: str) -> Callable[..., object]:
    return cast(Callable[..., object], load_object(spec, f"destination {name!r}: {key}"))


def _broker_options(name: str, options: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    unknown = set(options) - allowed - {"type", "url"}
    if unknown:
        raise ValueError(
            f"destination {name!r}: unknown option(s) {sorted(unknown)} for type {options.get('type')!r}; "
            f"known: {sorted(allowed | {'type', 'url'})}"
        )
    out = {k: v for k, v in options.items() if k in allowed}
    if "timeout" in out:
        out["timeout"] = float(out["timeout"])
    if "maxlen" in out:
        out["maxlen"] = int(out["maxlen"])
    return out


def transport_from_options(name: str, options: Mapping[str, Any]) -> Transport | None:
    """The transport of one configured destination (None: an entry point's options)."""
    kind = destination_type(name, options)
    if kind is None:
        return None
    if kind == "webhook":
        return webhook_from_options(name, {k: v for k, v in options.items() if k != "type"})
    if kind == "rabbitmq":
        from pginbox.brokers.rabbitmq import RabbitMQTransport

        opts = _broker_options(
            name,
            {**options, "type": kind},
            frozenset({"routing_key", "exchange", "producer", "message_type", "ordering_key", "timeout"}),
        )
        return RabbitMQTransport(str(options["url"]), destination=name, **opts)
    if kind == "nats":
        from pginbox.brokers.jetstream import JetStreamTransport

        opts = _broker_options(
            name, {**options, "type": kind}, frozenset({"subject", "producer", "message_type", "timeout"})
        )
        if "subject" not in opts:
            raise ValueError(f"destination {name!r}: a NATS destination needs subject")
        return JetStreamTransport(str(options["url"]), destination=name, **opts)
    if kind == "redis":
        from pginbox.brokers.redis import RedisStreamsTransport

        opts = _broker_options(
            name, {**options, "type": kind}, frozenset({"stream", "producer", "message_type", "maxlen", "timeout"})
        )
        if "stream" not in opts:
            raise ValueError(f"destination {name!r}: a Redis destination needs stream")
        return RedisStreamsTransport(str(options["url"]), destination=name, **opts)
    if kind == "kafka":
        from pginbox.brokers.kafka import KafkaTransport

        opts = _broker_options(
            name, {**options, "type": kind}, frozenset({"topic", "producer", "message_type", "timeout"})
        )
        if "topic" not in opts:
            raise ValueError(f"destination {name!r}: a Kafka destination needs topic")
        return KafkaTransport(str(options["url"]), destination=name, **opts)
    rest = {k: v for k, v in options.items() if k not in ("type", "callable", "factory")}
    if "callable" in options:
        if rest:
            raise ValueError(f"destination {name!r}: callable takes no options (use factory): {sorted(rest)}")
        return CallableTransport(_import(name, "callable", str(options["callable"])))
    if "factory" in options:
        return _entry_point_transport(name, _import(name, "factory", str(options["factory"])), rest)
    raise ValueError(f"destination {name!r}: type 'callable' needs callable or factory = 'module:function'")


_WEBHOOK_KEYS = frozenset({"url", "method", "headers", "timeout", "allow_hosts", "retry_on", "forward_on_redirect"})


def webhook_from_options(name: str, options: Mapping[str, Any]) -> WebhookTransport:
    unknown = set(options) - _WEBHOOK_KEYS
    if unknown:
        raise ValueError(f"destination {name!r}: unknown webhook option(s) {sorted(unknown)}")
    headers = options.get("headers") or {}
    if not isinstance(headers, Mapping):
        raise ValueError(f"destination {name!r}: headers must be a table")
    allow = options.get("allow_hosts") or []
    if isinstance(allow, str):
        allow = _split_list(allow)
    forward = options.get("forward_on_redirect") or []
    if isinstance(forward, str):
        forward = _split_list(forward)
    return WebhookTransport(
        url=str(options["url"]),
        method=str(options.get("method", "POST")),
        headers={str(k): str(v) for k, v in headers.items()},
        timeout=float(options.get("timeout", 10.0)),
        allow_hosts=[str(h) for h in allow],
        retry_on=parse_retry_on(options["retry_on"]) if "retry_on" in options else DEFAULT_RETRY_ON,
        forward_on_redirect=[str(h) for h in forward],
    )


def _entry_point_transport(name: str, factory: Callable[..., object], options: Mapping[str, Any]) -> Transport:
    made = factory(**options)
    if isinstance(made, Transport):
        return made
    if callable(made):
        return CallableTransport(made)
    raise TypeError(f"destination {name!r}: entry point factory returned {made!r}, not a Transport")


def find_entry_points() -> list[metadata.EntryPoint]:
    """The installed entry points of the group `pginbox.destinations`."""
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def destination_sections(
    path: str | os.PathLike[str] | None, *, environ: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """The destinations' options by name, from a TOML file and the environment (which wins), as
    load_config reads them, without building a transport (`pginbox outbox provision`, `doctor`)."""
    env = os.environ if environ is None else environ
    sections: dict[str, dict[str, Any]] = {}
    if path is not None:
        with Path(path).open("rb") as fh:
            doc = tomllib.load(fh)
        raw = doc.get("destinations", {})
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: [destinations] must be a table")
        for name, section in raw.items():
            if not isinstance(section, dict):
                raise ValueError(f"{path}: [destinations.{name}] must be a table")
            sections[name] = dict(section)
    # Destinations defined only by the environment.
    known_prefixes = {env_prefix(name) for name in sections}
    for key in env:
        ending = next((e for e in _DEFINING_ENV if key.endswith(e)), None)
        if key.startswith("PGINBOX_DEST_") and ending is not None:
            prefix = key[: -len(ending) + 1]
            if prefix not in known_prefixes:
                sections[prefix[len("PGINBOX_DEST_") : -1].lower()] = {}
                known_prefixes.add(prefix)
    return {name: _apply_env(name, section, env) for name, section in sections.items()}


def destination_names(path: str | os.PathLike[str] | None, *, environ: Mapping[str, str] | None = None) -> set[str]:
    """Every destination load_config would return: configured ones and entry points."""
    return set(destination_sections(path, environ=environ)) | {ep.name for ep in find_entry_points()}


def load_config(
    path: str | os.PathLike[str] | None,
    *,
    environ: Mapping[str, str] | None = None,
    use_entry_points: bool = True,
) -> dict[str, Transport]:
    """Destinations by name, from a TOML file, the environment and entry points."""
    sections = destination_sections(path, environ=environ)
    entry_points = {ep.name: ep for ep in find_entry_points()} if use_entry_points else {}
    transports: dict[str, Transport] = {}
    for name, options in sections.items():
        transport = transport_from_options(name, options)
        if transport is not None:
            if name in entry_points:
                raise ValueError(
                    f"destination {name!r} is both configured (url, callable or factory) and an entry point"
                )
            transports[name] = transport
        elif name not in entry_points:
            raise ValueError(
                f"destination {name!r}: no url and no entry point in group {ENTRY_POINT_GROUP!r} "
                "(nor callable / factory = 'module:function')"
            )
    for name, ep in entry_points.items():
        transports[name] = _entry_point_transport(name, ep.load(), sections.get(name, {}))
    return transports
