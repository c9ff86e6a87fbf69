"""`Effect`: one effect of the outbox, as inbox.claim_effects returns it (the dispatcher claims
them; transports deliver them). `idempotency_key(effect)` is the key every destination sends with
every attempt of it, so that the destination deduplicates."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, Protocol

__all__ = ["EFFECT_FIELDS", "Effect", "EffectLike", "idempotency_key"]


@dataclass(frozen=True)
class Effect:
    """One effect to deliver. The lease fields are set on a claimed effect (None / 0 on one made
    by hand, e.g. to try a transport). `idempotency_key`: the key the destination deduplicates
    on, scoped by the database per consumer and tenant (schemas that do not return it leave it
    None: the effect id is the key then). `consumer`: the consumer that enqueued it."""

    effect_id: str
    destination: str
    payload: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    attempts: int = 0
    ordering_key: str | None = None
    lease_token: int = 0
    lease_expires_at: datetime.datetime | None = None
    created_at: datetime.datetime | None = None
    consumer: str | None = None
    idempotency_key: str | None = None


#: The columns of inbox.claim_effects that Effect keeps (a newer schema may return more).
EFFECT_FIELDS: Final = frozenset(f.name for f in fields(Effect))


class EffectLike(Protocol):
    """What a transport reads from an effect (Effect has it, and so may a caller's own type)."""

    @property
    def effect_id(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


def idempotency_key(effect: object) -> str:
    """The key a destination deduplicates on: the effect's `idempotency_key` when the database
    returned one, else its effect id. Every destination (webhook Idempotency-Key, AMQP
    message_id, JetStream Pginbox-Message-Id, the Redis field) sends exactly this."""
    key = getattr(effect, "idempotency_key", None)
    return str(key) if key else str(getattr(effect, "effect_id"))  # noqa: B009
