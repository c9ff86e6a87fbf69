"""How the commands print: JSON, plain tables, values and ages. Every string goes out through
pginbox.textsafe.printable: a name or id holding an escape sequence cannot drive the terminal."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Sequence
from typing import Any

import click

from pginbox.textsafe import printable

__all__ = ["echo_json", "fmt", "format_age", "indent", "pg_interval", "table"]


def echo_json(value: Any) -> None:
    # json escapes C0 characters itself; DEL and C1 (U+009B is CSI to some terminals) it leaves raw.
    text = json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False)
    click.echo(_C1.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


_C1 = re.compile("[\x7f-\x9f]")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: columns as wide as their widest cell, numbers right-aligned."""
    cells = [[("-" if v is None else printable(str(v))) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    numeric = [all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def fmt(value: object) -> str:
    """One value of a `key: value` listing: '-' for none, times to the second, '' visible."""
    if value is None:
        return "-"
    if isinstance(value, datetime.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, datetime.timedelta):
        return pg_interval(value)
    if isinstance(value, str):
        return repr(value) if value == "" else printable(value)
    return printable(str(value))


def pg_interval(value: datetime.timedelta) -> str:
    """An interval as PostgreSQL prints it (IntervalStyle postgres): '11 days', '1 day 02:00:00',
    '00:05:00', '-1 days -02:00:00', '00:00:00.5'. psycopg reads an interval as a timedelta, one
    signed length: '26 hours' (which PostgreSQL keeps apart from days) prints as '1 day 02:00:00',
    and '-1 days +02:00:00' as '-22:00:00', the same length spelled as justify_hours() would."""
    sign = "-" if value < datetime.timedelta(0) else ""
    value = abs(value)
    days, seconds, micro = value.days, value.seconds, value.microseconds
    parts = []
    if days:
        parts.append(f"{sign}{days} day" if days == 1 and not sign else f"{sign}{days} days")
    if seconds or micro or not days:
        hours, rest = divmod(seconds, 3600)
        minutes, secs = divmod(rest, 60)
        clock = f"{sign}{hours:02d}:{minutes:02d}:{secs:02d}"
        if micro:
            clock += f".{micro:06d}".rstrip("0")
        parts.append(clock)
    return " ".join(parts)


def format_age(age: datetime.timedelta | None) -> str:
    """A short age: 42s, 7m, 3h, 12d."""
    if age is None:
        return "-"
    seconds = max(int(age.total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
