"""Text that reaches a terminal or a log line: control characters escaped, URLs without secrets.

Names and ids come from producers and callers (hostile until validated): since 0.3.0 the SQL API
refuses control characters in them, but rows written before still hold them, and error texts are
free. `printable` escapes C0, DEL and C1 characters so that no value can move the cursor, recolour
the terminal or forge a log line. A webhook URL often is the credential (Slack, Teams: the path is
the secret): `public_url` keeps scheme, host and port, and `redact_urls` puts that in place of every
spelling of the URL in a text (an error from the HTTP client, a redirect location).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = ["printable", "public_url", "redact_urls"]

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with every control character escaped (\\n, \\t, \\r, else \\xNN)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)


def public_url(url: str) -> str:
    """scheme://host[:port] of `url`, then "/…" when it has a path or a query (they may be the secret)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<url>"
    if ":" in host:
        host = f"[{host}]"
    tail = "/…" if parts.path not in ("", "/") or parts.query or parts.fragment else "/"
    return f"{parts.scheme}://{host}{port}{tail}"


def redact_urls(text: str, urls: Iterable[str]) -> str:
    """`text` with each of `urls` (and its path and query alone, as some errors quote them) replaced by
    its public form."""
    for url in sorted({str(u) for u in urls if u}, key=len, reverse=True):
        text = text.replace(url, public_url(url))
        try:
            parts = urlsplit(url)
        except ValueError:
            continue
        for secret in (parts.path + ("?" + parts.query if parts.query else ""), parts.query, parts.path):
            if len(secret) > 1:
                text = text.replace(secret, "/…" if secret.startswith("/") else "…")
        if parts.username or parts.password:
            text = text.replace(parts.netloc, parts.netloc.rsplit("@", 1)[-1])
    return text
