"""The SSRF guard of webhook transports.

At connect time the destination host is resolved, EVERY resolved address is checked, and the
connection goes to a checked address (no second resolution). Loopback, link-local
(169.254.169.254 included), private (RFC 1918, fc00::/7, shared 100.64/10), unspecified,
multicast, reserved and other non-global addresses are refused unless the operator allowlists the
host name or an address/CIDR (`allow_hosts`). No proxies (trust_env=False). A refusal raises
DestinationRefused, whose message starts with "refused:".
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from pginbox.errors import DestinationRefused

__all__ = ["AddressPolicy", "GuardedBackend", "GuardedHTTPTransport"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
