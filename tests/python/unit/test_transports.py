"""Webhook transport, SSRF guard and destination config, against a real HTTP server on 127.0.0.1.

No test connects outside 127.0.0.0/8: every TCP connect goes through a spy that fails the test
for any other address (private/metadata destinations must be refused before connecting).
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpcore
import pytest

from pginbox.transports import (
    AmbiguousDelivery,
    CallableTransport,
    DeliveryReport,
    Effect,
    Transport,
    WebhookTransport,
    config,
    load_config,
    ssrf,
)

LOCAL = ["127.0.0.1"]


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(entry)


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.recorder.add(
            {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
        )
        path = self.path
        if path == "/ok":
            self._reply(200, b'{"accepted": true}')
        elif path == "/big":
            self._reply(200, b"x" * 10_000)
        elif path == "/bad":
            self._reply(400, b"bad payload")
        elif path == "/conflict":
            self._reply(409, b"")
        elif path == "/unavailable":
            self._reply(503, b"try later")
        elif path == "/throttled":
            self._reply(429, b"slow down")
        elif path == "/slow":
            time.sleep(1.5)  # accepted the request, answers after the client's timeout
            self._reply(200, b"too late")
        elif path == "/redirect-private":
            self._redirect(302, "http://10.0.0.1/hook")
        elif path == "/redirect-metadata":
            self._redirect(307, "http://169.254.169.254/latest/meta-data/")
        elif path == "/redirect-local":
            self._redirect(307, "/ok")
        elif path == "/redirect-302":
            self._redirect(302, "/ok")
        elif path == "/redirect-other-origin":
            self._redirect(308, f"http://localhost:{self.server.server_address[1]}/ok")
        elif path == "/redirect-loop":
            self._redirect(302, "/redirect-loop")
        elif path.startswith("/services/") and "slow" in path:
            time.sleep(1.5)
            self._reply(200, b"too late")
        elif path.startswith("/services/") and "private" in path:
            self._redirect(302, "http://10.0.0.1/hooks/REDIRECT-SECRET?sig=REDIRECT-SIG")
        elif path.startswith("/services/"):
            self._reply(503, b"try later")
        else:
            self._reply(404, b"")

    do_POST = do_PUT = do_GET = _handle

    def _reply(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def _redirect(self, status: int, location: str) -> None:
        self.send_response(status)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    recorder: Recorder


@pytest.fixture
def server() -> Iterator[tuple[str, Recorder]]:
    srv = Server(("127.0.0.1", 0), Handler)
    srv.recorder = Recorder()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv.recorder
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every TCP connect; fail on anything but loopback (127.0.0.0/8, ::1)."""
    attempts: list[str] = []
    real = httpcore.SyncBackend.connect_tcp

    def spy(self: httpcore.SyncBackend, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        attempts.append(host)
        ip = ipaddress.ip_address(host)  # the guard connects to the checked address, never a name
        assert ip.is_loopback, f"connection attempted to {host}"
        return real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", spy)
    return attempts


def effect(effect_id: str = "eff-1", payload: Any = None, headers: dict[str, str] | None = None) -> Effect:
    return Effect(
        effect_id=effect_id,
        destination="hook",
        payload={"order": 42, "note": "é"} if payload is None else payload,
        headers=headers or {},
        attempts=0,
    )


def webhook(url: str, **kwargs: Any) -> WebhookTransport:
    kwargs.setdefault("allow_hosts", LOCAL)
    kwargs.setdefault("timeout", 5.0)
    return WebhookTransport(url, **kwargs)


def test_2xx_delivered_with_idempotency_key(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/ok", headers={"Authorization": "Bearer t", "Idempotency-Key": "spoof"}) as t:
        report = t.deliver(effect("eff-ok", headers={"X-Trace": "abc"}))
    assert report == DeliveryReport(200, '{"accepted": true}', False, None)
    assert report.delivered
    [req] = rec.requests
    assert req["method"] == "POST"
    assert req["headers"]["Idempotency-Key"] == "eff-ok"
    assert req["headers"]["Authorization"] == "Bearer t"
    assert req["headers"]["X-Trace"] == "abc"
    assert req["headers"]["Content-Type"] == "application/json"
    assert json.loads(req["body"]) == {"order": 42, "note": "é"}


def test_method_and_excerpt_limit(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/big", method="put") as t:
        report = t.deliver(effect())
    assert report.status_code == 200 and report.error is None
    assert report.response_excerpt == "x" * 2000
    assert rec.requests[0]["method"] == "PUT"


@pytest.mark.parametrize(
    ("path", "status", "retryable"),
    [
        ("/bad", 400, False),
        ("/conflict", 409, False),
        ("/nope", 404, False),
        ("/unavailable", 503, True),
        ("/throttled", 429, True),
    ],
)
def test_non_2xx(server: tuple[str, Recorder], path: str, status: int, retryable: bool) -> None:
    base, _ = server
    with webhook(base + path) as t:
        report = t.deliver(effect())
    assert report.status_code == status
    assert report.retryable is retryable
    assert report.error is not None and str(status) in report.error


def test_retry_on_is_configurable(server: tuple[str, Recorder]) -> None:
    base, _ = server
    with webhook(base + "/unavailable", retry_on=[429]) as t:
        assert t.deliver(effect()).retryable is False
    with webhook(base + "/conflict", retry_on=[409, range(500, 600)]) as t:
        assert t.deliver(effect()).retryable is True


def test_timeout_after_accept_is_ambiguous_and_keeps_key(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/slow", timeout=0.3) as t:
        for _ in range(2):  # the dispatcher's retry: same effect, same key
            with pytest.raises(AmbiguousDelivery):
                t.deliver(effect("eff-slow"))
    assert [r["headers"]["Idempotency-Key"] for r in rec.requests] == ["eff-slow", "eff-slow"]


def test_webhook_errors_never_quote_the_url(server: tuple[str, Recorder]) -> None:
    """A webhook URL is often the credential (Slack: /services/T…/B…/<secret>). The errors a delivery
    reports reach inbox.outbox.last_error, audit rows and the dispatcher's log: none may quote the URL
    (of the destination or of a redirect), only its scheme, host and port."""
    base, _ = server
    errors: list[str] = []
    for path in ("/services/T0/B0/SECRET-503?token=QUERY-SECRET", "/services/T0/B0/SECRET-private"):
        with webhook(base + path) as t:
            report = t.deliver(effect())
            errors.append(repr(t))
        assert report.error is not None
        errors.append(report.error)
    with webhook(base + "/services/T0/B0/SECRET-slow", timeout=0.3) as t, pytest.raises(AmbiguousDelivery) as ambiguous:
        t.deliver(effect())
    errors.append(str(ambiguous.value))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with webhook(f"http://user:PASSWORD@127.0.0.1:{port}/services/T0/B0/SECRET-refused", timeout=1.0) as t:
        report = t.deliver(effect())
    errors.append(report.error or "")
    with pytest.raises(ValueError) as bad:
        WebhookTransport("ftp://h/services/T0/B0/SECRET-config")
    errors.append(str(bad.value))
    leaked = [e for e in errors if any(secret in e for secret in ("SECRET", "PASSWORD", "REDIRECT-SIG"))]
    assert not leaked, leaked
    assert any("127.0.0.1" in e for e in errors), errors  # the host is still named


def test_connect_refused_is_retryable_report() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # nothing listens on `port` now: nothing was sent, so not ambiguous
    with webhook(f"http://127.0.0.1:{port}/x", timeout=1.0) as t:
        report = t.deliver(effect())
    assert report.status_code is None and report.retryable is True
    assert report.error is not None and "connect failed" in report.error


def test_loopback_refused_without_allowlist(server: tuple[str, Recorder], loopback_only: list[str]) -> None:
    base, rec = server
    with WebhookTransport(base + "/ok") as t:
        report = t.deliver(effect())
    assert report.retryable is False and report.status_code is None
    assert report.error is not None and report.error.startswith("refused:") and "loopback" in report.error
    assert rec.requests == [] and loopback_only == []


@pytest.mark.parametrize("allow", [["127.0.0.1"], ["127.0.0.0/8"]])
def test_loopback_allowed_with_allowlist(server: tuple[str, Recorder], allow: list[str]) -> None:
    base, rec = server
    with WebhookTransport(base + "/ok", allow_hosts=allow) as t:
        assert t.deliver(effect()).delivered
    assert len(rec.requests) == 1


def test_hostname_resolving_to_loopback_refused(server: tuple[str, Recorder], loopback_only: list[str]) -> None:
    base, rec = server
    port = base.rsplit(":", 1)[1]
    with WebhookTransport(f"http://localhost:{port}/ok") as t:
        report = t.deliver(effect())
    assert report.error is not None and report.error.startswith("refused:") and "'localhost'" in report.error
    assert not report.retryable
    assert rec.requests == [] and loopback_only == []
    # allowlisting the name (or the address) permits it; the connection goes to the checked address
    with WebhookTransport(f"http://localhost:{port}/ok", allow_hosts=["127.0.0.1", "::1"]) as t:
        assert t.deliver(effect()).delivered
    assert loopback_only and all(ipaddress.ip_address(h).is_loopback for h in loopback_only)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/hook",
        "http://192.168.1.1/",
        "http://[::1]:9/",
        "http://[fd00::1]/",
        "http://0.0.0.0:80/",
        "http://[::ffff:127.0.0.1]/",
        "http://224.0.0.1/",
        "https://169.254.169.254/",
    ],
)
def test_private_and_metadata_refused_before_connecting(url: str, loopback_only: list[str]) -> None:
    with WebhookTransport(url, timeout=1.0) as t:
        report = t.deliver(effect())
    assert report.error is not None and report.error.startswith("refused:")
    assert report.retryable is False
    assert loopback_only == []


def test_redirect_to_private_address_refused(server: tuple[str, Recorder], loopback_only: list[str]) -> None:
    base, rec = server
    for path in ("/redirect-private", "/redirect-metadata"):
        with webhook(base + path) as t:
            report = t.deliver(effect())
        assert report.error is not None and report.error.startswith("refused:"), report
        assert report.retryable is False
    assert [r["path"] for r in rec.requests] == ["/redirect-private", "/redirect-metadata"]
    assert all(ipaddress.ip_address(h).is_loopback for h in loopback_only)


def test_redirect_followed_with_check(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/redirect-local") as t:
        report = t.deliver(effect("eff-r"))
    assert report.delivered and report.status_code == 200
    assert [r["path"] for r in rec.requests] == ["/redirect-local", "/ok"]
    assert rec.requests[1]["method"] == "POST"  # 307 keeps method and body
    assert rec.requests[1]["headers"]["Idempotency-Key"] == "eff-r"
    assert json.loads(rec.requests[1]["body"]) == {"order": 42, "note": "é"}


def test_redirect_limit(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/redirect-loop") as t:
        report = t.deliver(effect())
    assert report.retryable is False and report.error is not None and "too many redirects" in report.error
    assert len(rec.requests) == 6


def test_forbidden_reason_table() -> None:
    reason = ssrf._forbidden_reason
    assert reason(ipaddress.ip_address("8.8.8.8")) is None
    assert reason(ipaddress.ip_address("2606:4700::1111")) is None
    assert reason(ipaddress.ip_address("169.254.169.254")) == "link-local"
    assert reason(ipaddress.ip_address("172.16.5.4")) == "private"
    assert reason(ipaddress.ip_address("fc00::1")) == "private"
    assert reason(ipaddress.ip_address("fe80::1")) == "link-local"
    assert reason(ipaddress.ip_address("::ffff:10.0.0.1")) == "private"
    assert reason(ipaddress.ip_address("100.64.0.1")) is not None
    assert reason(ipaddress.ip_address("240.0.0.1")) is not None


def test_bad_url_rejected() -> None:
    with pytest.raises(ValueError):
        WebhookTransport("file:///etc/passwd")


def test_load_config_toml_and_env(tmp_path: Path, server: tuple[str, Recorder]) -> None:
    base, rec = server
    cfg = tmp_path / "pginbox.toml"
    cfg.write_text(
        f"""
[destinations.billing]
url = "http://127.0.0.1:9/never"
method = "PUT"
headers = {{ Authorization = "Bearer file", X-Env = "file" }}
timeout = 3.5
allow_hosts = ["127.0.0.1"]
retry_on = [429, "500-599"]

[destinations.audit-log]
url = "{base}/ok"
""",
        encoding="utf-8",
    )
    env = {
        "PGINBOX_DEST_BILLING_URL": f"{base}/ok",
        "PGINBOX_DEST_BILLING_TIMEOUT": "2",
        "PGINBOX_DEST_BILLING_HEADERS": '{"X-Env": "env"}',
        "PGINBOX_DEST_AUDIT_LOG_ALLOW_HOSTS": "127.0.0.0/8, ::1",
        "PGINBOX_DEST_EXTRA_URL": f"{base}/unavailable",
        "PGINBOX_DEST_EXTRA_ALLOW_HOSTS": "127.0.0.1",
        "PGINBOX_DEST_EXTRA_RETRY_ON": "500-502",
    }
    dests = load_config(cfg, environ=env, use_entry_points=False)
    assert sorted(dests) == ["audit-log", "billing", "extra"]
    billing = dests["billing"]
    assert isinstance(billing, WebhookTransport)
    assert (billing.url, billing.method, billing.timeout) == (f"{base}/ok", "PUT", 2.0)
    assert billing.headers == {"Authorization": "Bearer file", "X-Env": "env"}
    assert billing.retry_on == (429, range(500, 600))
    assert billing.deliver(effect("eff-cfg")).delivered
    assert rec.requests[-1]["headers"]["X-Env"] == "env"
    assert rec.requests[-1]["method"] == "PUT"
    audit = dests["audit-log"]
    assert isinstance(audit, WebhookTransport)
    assert audit.allow_hosts == ("127.0.0.0/8", "::1") and audit.timeout == 10.0
    assert audit.deliver(effect()).delivered
    extra = dests["extra"]
    report = extra.deliver(effect())
    assert report.status_code == 503 and report.retryable is False  # 503 is outside its retry_on
    for t in dests.values():
        assert isinstance(t, WebhookTransport)
        t.close()


def test_load_config_rejects_unknown_options(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[destinations.x]\nurl = "http://example.com/"\nretries = 3\n', encoding="utf-8")
    with pytest.raises(ValueError, match="unknown webhook option"):
        load_config(cfg, environ={}, use_entry_points=False)
    cfg.write_text("[destinations.y]\nmethod = 'POST'\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no url and no entry point"):
        load_config(cfg, environ={}, use_entry_points=False)


def test_entry_point_destinations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    (tmp_path / "_pginbox_ep_dest.py").write_text(
        "from pginbox.transports import DeliveryReport\n"
        "SEEN = []\n"
        "def plain():\n"
        "    return SEEN.append\n"
        "class Custom:\n"
        "    def __init__(self, level='debug'):\n"
        "        self.level = level\n"
        "    def deliver(self, effect):\n"
        "        return DeliveryReport(None, self.level, False, None)\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        metadata.EntryPoint("noop", "_pginbox_ep_dest:plain", config.ENTRY_POINT_GROUP),
        metadata.EntryPoint("audit", "_pginbox_ep_dest:Custom", config.ENTRY_POINT_GROUP),
    ]

    monkeypatch.setattr(config, "find_entry_points", lambda: eps)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[destinations.audit]\nlevel = "info"\n', encoding="utf-8")
    dests = load_config(cfg, environ={})
    assert sorted(dests) == ["audit", "noop"]
    assert isinstance(dests["noop"], CallableTransport)
    assert dests["noop"].deliver(effect("e-noop")).delivered
    assert isinstance(dests["audit"], Transport)
    assert dests["audit"].deliver(effect()).response_excerpt == "info"
    import _pginbox_ep_dest  # type: ignore[import-not-found]

    assert [e.effect_id for e in _pginbox_ep_dest.SEEN] == ["e-noop"]


def test_302_keeps_payload_and_cross_origin_drops_credentials(server: tuple[str, Recorder]) -> None:
    base, rec = server
    with webhook(base + "/redirect-302", headers={"Authorization": "Bearer t"}) as t:
        assert t.deliver(effect("eff-302")).delivered
    hop = rec.requests[1]
    assert (hop["path"], hop["method"]) == ("/ok", "POST")
    assert json.loads(hop["body"]) == {"order": 42, "note": "é"}
    assert hop["headers"]["Authorization"] == "Bearer t"  # same origin
    rec.requests.clear()
    allow = ["127.0.0.1", "localhost"]
    with webhook(base + "/redirect-other-origin", headers={"Authorization": "Bearer t"}, allow_hosts=allow) as t:
        assert t.deliver(effect("eff-308")).delivered
    hop = rec.requests[1]
    assert hop["headers"]["Host"].startswith("localhost:")
    assert "Authorization" not in hop["headers"]
    assert hop["headers"]["Idempotency-Key"] == "eff-308"


def _fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[str]]) -> list[str]:
    """Make transports' resolver answer `table` (name -> addresses); returns the names looked up."""
    import socket

    asked: list[str] = []

    def getaddrinfo(host: str, port: int) -> list[Any]:
        asked.append(host)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in table[host]
        ]

    monkeypatch.setattr(ssrf, "_getaddrinfo", getaddrinfo)
    return asked


def test_every_resolved_address_is_checked(monkeypatch: pytest.MonkeyPatch, loopback_only: list[str]) -> None:
    asked = _fake_dns(monkeypatch, {"mixed.example": ["93.184.216.34", "10.1.2.3"]})
    with WebhookTransport("http://mixed.example/hook", timeout=1.0) as t:
        report = t.deliver(effect())
    assert asked == ["mixed.example"]
    assert report.error is not None and "private address 10.1.2.3" in report.error and not report.retryable
    assert loopback_only == []


def test_connects_to_the_checked_address(
    server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch, loopback_only: list[str]
) -> None:
    base, rec = server
    port = base.rsplit(":", 1)[1]
    asked = _fake_dns(monkeypatch, {"hooks.test": ["127.0.0.1"]})
    with webhook(f"http://hooks.test:{port}/ok", allow_hosts=["127.0.0.0/8"]) as t:
        assert t.deliver(effect()).delivered
    assert asked == ["hooks.test"]  # resolved once, by the guard
    assert loopback_only == ["127.0.0.1"]  # the connection went to the checked address, not the name
    assert rec.requests[0]["headers"]["Host"] == f"hooks.test:{port}"


def test_effect_headers_never_override_configured_or_dispatcher_headers(server: tuple[str, Recorder]) -> None:
    """Effects enqueued before 0.2.0 were not checked: their headers still cannot take over the request."""
    base, rec = server
    configured = {"Authorization": "Bearer configured", "X-Api-Key": "configured"}
    hostile = {
        "Host": "evil.example",
        "authorization": "Bearer effect",
        "x-api-key": "effect",
        "Content-Length": "1",
        "Transfer-Encoding": "chunked",
        "Connection": "close",
        "Upgrade": "h2c",
        "Cookie": "s=1",
        "Idempotency-Key": "spoof",
        "X-Trace": "kept",
    }
    with webhook(base + "/ok", headers=configured) as t:
        assert t.deliver(effect("eff-hdr", headers=hostile)).delivered
    sent = {k.lower(): v for k, v in rec.requests[0]["headers"].items()}
    assert sent["host"] == base.removeprefix("http://")
    assert sent["authorization"] == "Bearer configured" and sent["x-api-key"] == "configured"
    assert sent["idempotency-key"] == "eff-hdr" and sent["x-trace"] == "kept"
    assert sent["content-length"] == str(len(rec.requests[0]["body"]))
    assert "transfer-encoding" not in sent and "upgrade" not in sent and "cookie" not in sent
    assert sent.get("connection") != "close"


def test_cross_origin_redirect_drops_every_configured_header_unless_marked(server: tuple[str, Recorder]) -> None:
    base, rec = server
    allow = ["127.0.0.1", "localhost"]
    configured = {"X-Api-Key": "secret", "X-Tenant": "acme", "Authorization": "Bearer t"}
    with webhook(
        base + "/redirect-other-origin",
        headers=configured,
        allow_hosts=allow,
        forward_on_redirect=["x-tenant", "Authorization"],
    ) as t:
        assert t.deliver(effect("eff-xo", headers={"X-Trace": "abc"})).delivered
    first, hop = rec.requests
    assert first["headers"]["X-Api-Key"] == "secret"
    assert hop["headers"]["Host"].startswith("localhost:")
    assert "X-Api-Key" not in hop["headers"]  # a configured header is a secret by default
    assert "Authorization" not in hop["headers"]  # credentials never follow, marked or not
    assert hop["headers"]["X-Tenant"] == "acme" and hop["headers"]["X-Trace"] == "abc"
    assert hop["headers"]["Idempotency-Key"] == "eff-xo"


def test_forward_on_redirect_from_the_file_and_the_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "pginbox.toml"
    cfg.write_text(
        '[destinations.a]\nurl = "http://127.0.0.1:9/a"\nforward_on_redirect = ["X-Tenant"]\n'
        '[destinations.b]\nurl = "http://127.0.0.1:9/b"\n',
        encoding="utf-8",
    )
    dests = load_config(cfg, environ={"PGINBOX_DEST_B_FORWARD_ON_REDIRECT": "X-One, x-two"}, use_entry_points=False)
    a, b = dests["a"], dests["b"]
    assert isinstance(a, WebhookTransport) and isinstance(b, WebhookTransport)
    assert a.forward_on_redirect == {"x-tenant"} and b.forward_on_redirect == {"x-one", "x-two"}
