"""Destinations for the outbox dispatcher: HTTP(S) webhooks and Python callables.

A transport delivers one effect and reports what happened:

    transport.deliver(effect) -> DeliveryReport(status_code, response_excerpt, retryable, error)

  delivered            error is None (status_code/response_excerpt describe the remote answer)
  retryable failure    error set, retryable=True  (the dispatcher backs off and retries)
  permanent failure    error set, retryable=False (the effect goes dead, visible to operators)
  ambiguous outcome    deliver() RAISES (AmbiguousDelivery for webhooks): the request may have
                       reached the remote (timeout or connection lost after sending); the
                       dispatcher retries with the SAME idempotency key.

Webhooks (WebhookTransport)
  The payload is sent as JSON with `Idempotency-Key: <effect id>` (never overridable). Headers: the
  effect's own headers, then the configured headers, which always win (names compared without
  case); an effect never sets Host, credentials (Authorization, Proxy-Authorization, Cookie),
  framing (Content-Length, Transfer-Encoding), hop-by-hop headers or the idempotency key: those are
  dropped from the effect's headers (enqueue_effect refuses them since 0.2.0; older effects may
  still carry them). 2xx is delivered (response excerpt <= 2000
  characters); a status in `retry_on` (default 408, 425, 429, 500-599) is retryable; any other
  status is permanent. A connect failure (nothing was sent) is a retryable report.

  SSRF guard: at connect time the destination host is resolved, EVERY resolved address is checked,
  and the connection goes to a checked address (no second resolution). Loopback, link-local
  (169.254.169.254 included), private (RFC 1918, fc00::/7, shared 100.64/10), unspecified,
  multicast, reserved and other non-global addresses are refused unless the operator allowlists
  the host name or an address/CIDR (`allow_hosts`). Redirects are followed by hand (at most 5),
  each hop going through the same check; environment proxies are ignored (trust_env=False).
  301/302/307/308 keep the method and the payload; 303 is followed with GET. When a redirect
  changes the origin, every configured header is treated as a secret and dropped, unless the
  destination lists it in `forward_on_redirect`; Authorization, Proxy-Authorization and Cookie are
  dropped in any case.
  A refusal is a permanent report whose error starts with "refused:".

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

import ipaddress
import json
import os
import socket
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpcore
import httpx

__all__ = [
    "DEFAULT_RETRY_ON",
    "AmbiguousDelivery",
    "CallableTransport",
    "DeliveryReport",
    "DestinationRefused",
    "Effect",
    "EffectLike",
    "Transport",
    "WebhookTransport",
    "load_config",
]

EXCERPT_CHARS = 2000
MAX_REDIRECTS = 5
ENTRY_POINT_GROUP = "pginbox.destinations"
DEFAULT_RETRY_ON: tuple[int | range, ...] = (408, 425, 429, range(500, 600))
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_SENSITIVE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
# What an effect's headers never set (the dispatcher's: target, credentials, framing, hop-by-hop,
# the idempotency key); the same list inbox._headers_ok refuses at enqueue.
_DISPATCHER_HEADERS = frozenset({
    "host", "authorization", "proxy-authorization", "cookie", "content-length", "transfer-encoding", "connection",
    "keep-alive", "proxy-connection", "proxy-authenticate", "te", "trailer", "upgrade", "idempotency-key",
})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Effect:
    """One effect to deliver (as claimed from the outbox)."""

    effect_id: str
    destination: str
    payload: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    attempts: int = 0


@dataclass(frozen=True)
class DeliveryReport:
    """What a transport learned. `error` None: the destination accepted the effect. Otherwise a
    failure, retried (same effect id) when `retryable`, else the effect goes dead."""

    status_code: int | None = None
    response_excerpt: str | None = None
    retryable: bool = True
    error: str | None = None

    @property
    def delivered(self) -> bool:
        return self.error is None

    @classmethod
    def ok(cls, status_code: int | None = None, response_excerpt: str | None = None) -> DeliveryReport:
        return cls(status_code, response_excerpt, True, None)

    @classmethod
    def failed(
        cls, error: str, *, retryable: bool, status_code: int | None = None, response_excerpt: str | None = None
    ) -> DeliveryReport:
        return cls(status_code, response_excerpt, retryable, error or "failed")


class EffectLike(Protocol):
    """What a transport reads from an effect (pginbox.dispatcher.Effect has these too)."""

    @property
    def effect_id(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


@runtime_checkable
class Transport(Protocol):
    """Delivers one effect. Returns a DeliveryReport when the outcome is known; raises when it is
    ambiguous (timeout, connection reset after sending): the effect is retried with the same id."""

    def deliver(self, effect: Any) -> DeliveryReport: ...


class AmbiguousDelivery(Exception):
    """The request may have reached the remote: retry with the same idempotency key."""


class DestinationRefused(Exception):
    """The SSRF guard refused a destination address."""


# --------------------------------------------------------------------------------------------
# SSRF guard


def _forbidden_reason(ip: IPAddress) -> str | None:
    """Why this address is not a public destination (None: it is)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _forbidden_reason(ip.ipv4_mapped)
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
    )
    for reason, hit in checks:
        if hit:
            return reason
    if not ip.is_global:
        return "non-global"
    return None


class AddressPolicy:
    """The operator's allowlist: host names (exact, case-insensitive) and addresses/CIDRs."""

    def __init__(self, allow_hosts: Iterable[str] = ()) -> None:
        self.names: set[str] = set()
        self.networks: list[IPNetwork] = []
        for entry in allow_hosts:
            text = entry.strip()
            if not text:
                continue
            try:
                self.networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            except ValueError:
                self.names.add(text.lower().rstrip("."))

    def host_allowed(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def address_allowed(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)

    def check(self, host: str, addresses: Iterable[IPAddress]) -> None:
        """Raise DestinationRefused unless every address is public or allowlisted."""
        if self.host_allowed(host):
            return
        for ip in addresses:
            reason = _forbidden_reason(ip)
            if reason is not None and not self.address_allowed(ip):
                raise DestinationRefused(
                    f"refused: destination host {host!r} resolves to {reason} address {ip} "
                    f"(allowlist the host or address in allow_hosts to permit it)"
                )


def _getaddrinfo(host: str, port: int) -> list[tuple[Any, ...]]:
    """The resolver (a seam for tests)."""
    return list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))


def _resolve(host: str, port: int) -> list[IPAddress]:
    literal = host.strip("[]")
    try:
        return [ipaddress.ip_address(literal)]
    except ValueError:
        pass
    try:
        infos = _getaddrinfo(literal, port)
    except socket.gaierror as exc:
        raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise httpcore.ConnectError(f"cannot resolve {host!r}: no addresses")
    return addresses


class GuardedBackend(httpcore.NetworkBackend):
    """Resolves, checks every address, then connects to a checked address."""

    def __init__(self, policy: AddressPolicy, inner: httpcore.NetworkBackend | None = None) -> None:
        self.policy = policy
        self.inner = inner if inner is not None else httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = _resolve(host, port)
        self.policy.check(host, addresses)
        last: Exception | None = None
        for ip in addresses:
            try:
                return self.inner.connect_tcp(
                    str(ip), port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise DestinationRefused("refused: unix sockets are not webhook destinations")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class GuardedHTTPTransport(httpx.HTTPTransport):
    """httpx transport whose connections go through GuardedBackend; no proxies."""

    def __init__(self, policy: AddressPolicy) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(policy),
        )


# --------------------------------------------------------------------------------------------
# Webhooks


def _status_matches(status: int, retry_on: Iterable[int | range]) -> bool:
    return any(status in rule if isinstance(rule, range) else status == rule for rule in retry_on)


def parse_retry_on(items: Iterable[object]) -> tuple[int | range, ...]:
    """Statuses and "lo-hi" ranges (ints, strings like "429" or "500-599", or ranges)."""
    rules: list[int | range] = []
    for item in items:
        if isinstance(item, range) or (isinstance(item, int) and not isinstance(item, bool)):
            rules.append(item)
        elif isinstance(item, str) and "-" in item:
            lo, hi = item.split("-", 1)
            rules.append(range(int(lo), int(hi) + 1))
        elif isinstance(item, str) and item.strip():
            rules.append(int(item))
        else:
            raise ValueError(f"retry_on: not a status or range: {item!r}")
    return tuple(rules)


class WebhookTransport:
    """POST (or `method`) the effect's payload as JSON to `url`; see the module docstring."""

    def __init__(
        self,
        url: str,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        allow_hosts: Iterable[str] = (),
        retry_on: Iterable[int | range] = DEFAULT_RETRY_ON,
        forward_on_redirect: Iterable[str] = (),
    ) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"webhook url must be http(s)://host/...: {url!r}")
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.timeout = float(timeout)
        self.allow_hosts = tuple(allow_hosts)
        self.retry_on = tuple(retry_on)
        self.forward_on_redirect = frozenset(name.lower() for name in forward_on_redirect)
        # Dropped when a redirect changes the origin: every configured header not marked to follow.
        self._secret_headers = (frozenset(name.lower() for name in self.headers) - self.forward_on_redirect) \
            | _SENSITIVE_HEADERS
        self._client = httpx.Client(
            transport=GuardedHTTPTransport(AddressPolicy(self.allow_hosts)),
            timeout=httpx.Timeout(self.timeout),
            follow_redirects=False,
            trust_env=False,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> WebhookTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WebhookTransport({self.method} {self.url})"

    def _request_headers(self, effect: EffectLike) -> dict[str, str]:
        # By lower-case name, so that "x-a" from the effect cannot ride along with a configured "X-A".
        merged: dict[str, tuple[str, str]] = {"content-type": ("Content-Type", "application/json")}
        for name, value in effect.headers.items():
            if name.lower() not in _DISPATCHER_HEADERS:
                merged[name.lower()] = (name, str(value))
        for name, value in self.headers.items():  # configured headers win
            if name.lower() != "idempotency-key":
                merged[name.lower()] = (name, str(value))
        merged["idempotency-key"] = ("Idempotency-Key", effect.effect_id)
        return dict(merged.values())

    def deliver(self, effect: EffectLike) -> DeliveryReport:
        body = json.dumps(effect.payload, separators=(",", ":"), ensure_ascii=False).encode()
        method = self.method
        url = httpx.URL(self.url)
        headers = self._request_headers(effect)
        content: bytes | None = body
        for _hop in range(MAX_REDIRECTS + 1):
            try:
                status, excerpt, location = self._send(method, url, headers, content)
            except DestinationRefused as exc:
                return DeliveryReport(None, None, False, str(exc))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                # Nothing was sent: an ordinary retryable failure.
                return DeliveryReport(None, None, True, f"connect failed: {type(exc).__name__}: {exc}")
            except httpx.UnsupportedProtocol as exc:
                return DeliveryReport(None, None, False, f"unsupported url: {exc}")
            except httpx.TransportError as exc:
                raise AmbiguousDelivery(
                    f"outcome unknown for effect {effect.effect_id} at {url}: {type(exc).__name__}: {exc}"
                ) from exc
            if status in _REDIRECT_STATUSES and location is not None:
                try:
                    target = url.join(location)
                except httpx.InvalidURL as exc:
                    return DeliveryReport(status, excerpt, False, f"invalid redirect location {location!r}: {exc}")
                if target.scheme not in ("http", "https"):
                    return DeliveryReport(status, excerpt, False, f"refused: redirect to {target.scheme} url")
                # 301/302/307/308 keep the method and the payload (a webhook that lost its payload on
                # a redirect must not count as delivered); 303 means "processed, see the result": GET.
                if status == 303 and method != "HEAD":
                    method, content = "GET", None
                    headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
                if (target.scheme, target.host, target.port) != (url.scheme, url.host, url.port):
                    headers = {k: v for k, v in headers.items() if k.lower() not in self._secret_headers}
                url = target
                continue
            if 200 <= status < 300:
                return DeliveryReport(status, excerpt, False, None)
            retryable = _status_matches(status, self.retry_on)
            return DeliveryReport(status, excerpt, retryable, f"HTTP {status} from {url.host}")
        return DeliveryReport(None, None, False, f"too many redirects (more than {MAX_REDIRECTS})")

    def _send(
        self, method: str, url: httpx.URL, headers: Mapping[str, str], content: bytes | None
    ) -> tuple[int, str | None, str | None]:
        with self._client.stream(method, url, headers=headers, content=content) as response:
            raw = bytearray()
            deadline = time.monotonic() + self.timeout
            try:
                for chunk in response.iter_raw():
                    raw.extend(chunk)
                    if len(raw) >= EXCERPT_CHARS * 4 or time.monotonic() > deadline:
                        break
            except httpx.TransportError:
                pass  # the status is known: an incomplete body only shortens the excerpt
            encoding = response.charset_encoding or "utf-8"
            try:
                text = raw.decode(encoding, errors="replace")
            except LookupError:
                text = raw.decode("utf-8", errors="replace")
            excerpt = text[:EXCERPT_CHARS] if raw else None
            return response.status_code, excerpt, response.headers.get("location")


# --------------------------------------------------------------------------------------------
# Python callables


class CallableTransport:
    """Wraps `fn(effect)`: delivered when it returns, ambiguous (re-raised) when it raises."""

    def __init__(self, fn: Callable[[Any], object]) -> None:
        self.fn = fn

    def deliver(self, effect: Any) -> DeliveryReport:
        result = self.fn(effect)
        if isinstance(result, DeliveryReport):
            return result
        return DeliveryReport(None, None, False, None)


# --------------------------------------------------------------------------------------------
# Configuration


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
