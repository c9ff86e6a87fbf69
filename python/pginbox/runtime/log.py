"""`kv`: one structured log line, `event key=value ...`, for the daemons' loggers."""

from __future__ import annotations

from pginbox.textsafe import printable

__all__ = ["kv", "safe_url"]


def kv(event: str, **fields: object) -> str:
    """A structured log line: `event key=value ...`. Values come from brokers and databases
    (message ids, error texts): control characters are escaped (pginbox.textsafe.printable), so
    that no value can forge a line, and a value with spaces, quotes or '=' is quoted."""
    parts = [event]
    for key, value in fields.items():
        raw = "-" if value is None else str(value)
        if not raw or any(c.isspace() or c in '"=' for c in raw):
            text = '"' + printable(raw.replace("\\", "\\\\").replace('"', '\\"')) + '"'
        else:
            text = printable(raw)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def safe_url(url: str) -> str:
    """A broker URL without its user and password, for messages and logs: what stands before the
    last '@' of the host part goes (an '@' in the path or query stays)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{tail}"
