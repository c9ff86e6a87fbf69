"""`kv`: one structured log line, `event key=value ...`, for the daemons' loggers."""

from __future__ import annotations

__all__ = ["kv", "safe_url"]

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _quote(text: str) -> str:
    # Values come from brokers and databases (message ids, error texts): a control character must
    # never start a line of its own in the log.
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif c < " " or c == "\x7f":
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def kv(event: str, **fields: object) -> str:
    """A structured log line: `event key=value ...` (a value with spaces, quotes, '=' or control
    characters is quoted, its control characters escaped)."""
    parts = [event]
    for key, value in fields.items():
        text = "-" if value is None else str(value)
        if not text or any(c.isspace() or c in '"=' or c < " " or c == "\x7f" for c in text):
            text = _quote(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def safe_url(url: str) -> str:
    """A broker URL without its user and password, for messages and logs: what stands before the
    last '@' of the host part goes (an '@' in the path or query stays)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{tail}"
