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
from typing import Any

from pginbox.transports.callable import CallableTransport
from pginbox.transports.protocol import Transport
from pginbox.transports.webhook import DEFAULT_RETRY_ON, WebhookTransport, parse_retry_on

__all__ = ["ENTRY_POINT_GROUP", "env_prefix", "find_entry_points", "load_config", "webhook_from_options"]

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
    return merged


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


def load_config(
    path: str | os.PathLike[str] | None,
    *,
    environ: Mapping[str, str] | None = None,
    use_entry_points: bool = True,
) -> dict[str, Transport]:
    """Destinations by name, from a TOML file, the environment and entry points."""
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
        if key.startswith("PGINBOX_DEST_") and key.endswith("_URL"):
            prefix = key[: -len("URL")]
            if prefix not in known_prefixes:
                sections[prefix[len("PGINBOX_DEST_") : -1].lower()] = {}
                known_prefixes.add(prefix)

    entry_points = {ep.name: ep for ep in find_entry_points()} if use_entry_points else {}
    transports: dict[str, Transport] = {}
    for name, section in sections.items():
        options = _apply_env(name, section, env)
        if "url" in options:
            if name in entry_points:
                raise ValueError(f"destination {name!r} is both a webhook (url) and an entry point")
            transports[name] = webhook_from_options(name, options)
        elif name not in entry_points:
            raise ValueError(f"destination {name!r}: no url and no entry point in group {ENTRY_POINT_GROUP!r}")
    for name, ep in entry_points.items():
        transports[name] = _entry_point_transport(name, ep.load(), sections.get(name, {}))
    return transports
