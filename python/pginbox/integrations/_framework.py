"""What the framework integrations (pginbox.integrations.celery, .faststream) share with
`pginbox consume`: identity sources, the verdict of an error, the memory of hand-backs. Nothing
here is new policy: each piece names the consumer's code it reuses.
"""

from __future__ import annotations

from collections.abc import Mapping

from pginbox.brokers.wire import DEFAULT_SOURCES, IDENTITY_FIELDS, IdentitySource
from pginbox.consumer.core import HandedBack, _action, _fix, _one_line

__all__ = ["HandedBack", "error_action", "fix_hint", "one_line", "sources"]

#: The consumer's verdict of an error raised instead of a Result (RETRY, DEAD_LETTER, HALT).
error_action = _action
fix_hint = _fix
one_line = _one_line


def sources(broker: str, overrides: Mapping[str, str] | None = None) -> dict[str, IdentitySource]:
    """Where each identity field is read, as `pginbox consume` reads it (the [consume] table's
    producer=, message_id=, ... settings in `overrides`; the broker's defaults otherwise)."""
    given = dict(overrides or {})
    unknown = set(given) - set(IDENTITY_FIELDS)
    if unknown:
        raise ValueError(f"unknown identity fields {sorted(unknown)}: expected some of {list(IDENTITY_FIELDS)}")
    return {
        name: IdentitySource.parse(str(given.get(name, DEFAULT_SOURCES[broker][name])), name, broker)
        for name in IDENTITY_FIELDS
    }
