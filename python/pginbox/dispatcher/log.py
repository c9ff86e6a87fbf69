"""The dispatcher's log: logger `pginbox.dispatcher`, one `event key=value ...` line per event."""

from __future__ import annotations

import logging

from pginbox.textsafe import printable

__all__ = ["kv", "log"]

log = logging.getLogger("pginbox.dispatcher")


def kv(event: str, **fields: object) -> str:
    """A structured log line: `event key=value ...` (values with spaces quoted)."""
    parts = [event]
    for key, value in fields.items():
        text = "-" if value is None else printable(str(value))
        if not text or any(c.isspace() or c in '"=' for c in text):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)
