"""`WebhookTransport`: POST (or `method`) the effect's payload as JSON to a URL.

The payload goes with `Idempotency-Key: <effect id>` (never overridable). Headers: the effect's own,
then the configured ones, which always win (names compared without case); an effect never sets
Host, credentials (Authorization, Proxy-Authorization, Cookie), framing (Content-Length,
Transfer-Encoding), hop-by-hop headers or the idempotency key: those are dropped from its headers
(enqueue_effect refuses them since 0.2.0; older effects may still carry them). 2xx is delivered
(response excerpt <= 2000 characters); a status in `retry_on` (default 408, 425, 429, 500-599) is
retryable; any other status is permanent. A connect failure (nothing was sent) is a retryable
report; a failure after sending raises AmbiguousDelivery. Every connection goes through the SSRF
guard (pginbox.transports.ssrf); redirects are followed by hand (at most 5), each hop checked again:
301/302/307/308 keep the method and the payload, 303 is followed with GET. When a redirect changes
the origin, every configured header is treated as a secret and dropped, unless the destination
lists it in `forward_on_redirect`; Authorization, Proxy-Authorization and Cookie are dropped always.
A webhook URL is often the credential itself (Slack, Teams): the errors this transport reports (which
reach inbox.outbox.last_error, the audit rows and the dispatcher's log) name a URL only by its scheme,
host and port (pginbox.textsafe.public_url), redirect targets included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping

import httpx

from pginbox.errors import AmbiguousDelivery, DestinationRefused
from pginbox.sql_limits import EXCERPT_CHARS  # the excerpt kept: what inbox.outbox keeps
from pginbox.textsafe import public_url, redact_urls
from pginbox.transports.effect import EffectLike, delivery_key
from pginbox.transports.protocol import DeliveryReport
from pginbox.transports.ssrf import AddressPolicy, GuardedHTTPTransport

__all__ = ["DEFAULT_RETRY_ON", "MAX_REDIRECTS", "WebhookTransport", "parse_retry_on"]

MAX_REDIRECTS = 5
DEFAULT_RETRY_ON: tuple[int | range, ...] = (408, 425, 429, range(500, 600))
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_SENSITIVE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
# What an effect's headers never set (the dispatcher's: target, credentials, framing, hop-by-hop,
# the idempotency key); the same list inbox._headers_ok refuses at enqueue.
_DISPATCHER_HEADERS = frozenset(
    {
        "host",
        "authorization",
        "proxy-authorization",
        "cookie",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "idempotency-key",
    }
)


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
            raise ValueError(f"webhook url must be http(s)://host/...: {public_url(url)!r}")
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.timeout = float(timeout)
        self.allow_hosts = tuple(allow_hosts)
        self.retry_on = tuple(retry_on)
        self.forward_on_redirect = frozenset(name.lower() for name in forward_on_redirect)
        # Dropped when a redirect changes the origin: every configured header not marked to follow.
        self._secret_headers = (
            frozenset(name.lower() for name in self.headers) - self.forward_on_redirect
        ) | _SENSITIVE_HEADERS
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
        return f"WebhookTransport({self.method} {public_url(self.url)})"

    def _request_headers(self, effect: EffectLike) -> dict[str, str]:
        # By lower-case name, so that "x-a" from the effect cannot ride along with a configured "X-A".
        merged: dict[str, tuple[str, str]] = {"content-type": ("Content-Type", "application/json")}
        for name, value in effect.headers.items():
            if name.lower() not in _DISPATCHER_HEADERS:
                merged[name.lower()] = (name, str(value))
        for name, value in self.headers.items():  # configured headers win
            if name.lower() != "idempotency-key":
                merged[name.lower()] = (name, str(value))
        merged["idempotency-key"] = ("Idempotency-Key", delivery_key(effect))
        return dict(merged.values())

    def deliver(self, effect: EffectLike) -> DeliveryReport:
        seen = [self.url]  # every URL of this delivery: no error may quote one whole

        def redacted(report: DeliveryReport) -> DeliveryReport:
            if report.error is None:
                return report
            return DeliveryReport(
                report.status_code, report.response_excerpt, report.retryable, redact_urls(report.error, seen)
            )

        body = json.dumps(effect.payload, separators=(",", ":"), ensure_ascii=False).encode()
        method = self.method
        url = httpx.URL(self.url)
        headers = self._request_headers(effect)
        content: bytes | None = body
        for _hop in range(MAX_REDIRECTS + 1):
            try:
                status, excerpt, location = self._send(method, url, headers, content)
            except DestinationRefused as exc:
                return redacted(DeliveryReport(None, None, False, str(exc)))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                # Nothing was sent: an ordinary retryable failure.
                return redacted(DeliveryReport(None, None, True, f"connect failed: {type(exc).__name__}: {exc}"))
            except httpx.UnsupportedProtocol as exc:
                return redacted(DeliveryReport(None, None, False, f"unsupported url: {exc}"))
            except httpx.TransportError as exc:
                raise AmbiguousDelivery(
                    redact_urls(
                        f"outcome unknown for effect {effect.effect_id} at {url}: {type(exc).__name__}: {exc}", seen
                    )
                ) from exc
            if status in _REDIRECT_STATUSES and location is not None:
                seen.append(location)
                try:
                    target = url.join(location)
                except httpx.InvalidURL as exc:
                    return redacted(
                        DeliveryReport(status, excerpt, False, f"invalid redirect location {location!r}: {exc}")
                    )
                seen.append(str(target))
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
