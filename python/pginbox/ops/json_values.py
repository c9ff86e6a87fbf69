"""Database values as JSON: what `--json` prints and what the as_json() methods return."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
from collections.abc import Mapping
from typing import Any

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """`value` with datetimes, intervals, bytes and decimals turned into JSON types."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value
