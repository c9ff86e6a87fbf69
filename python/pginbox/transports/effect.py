"""`Effect`: one effect of the outbox, as inbox.claim_effects returns it (the dispatcher claims
them; transports deliver them). Every attempt carries the same key, `delivery_key(effect)`: the
`idempotency_key` claim_effects returns (since 0.3.0 derived from consumer, tenant and effect id,
so that two consumers sharing a destination never send each other's key), else the effect id."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Effect", "EffectLike", "delivery_key"]


@dataclass(frozen=True)
class Effect:
    """One effect to deliver. The lease fields are set on a claimed effect (None / 0 on one made
    by hand, e.g. to try a transport)."""

    effect_id: str
    destination: str
    payload: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    attempts: int = 0
    ordering_key: str | None = None
    lease_token: int = 0
    lease_expires_at: datetime.datetime | None = None
    created_at: datetime.datetime | None = None
    idempotency_key: str | None = None


class EffectLike(Protocol):
    """What a transport reads from an effect (Effect has it, and so may a caller's own type)."""

    @property
    def effect_id(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


def delivery_key(effect: EffectLike) -> str:
    """The key the destination deduplicates on: the same on every attempt of the effect."""
    key = getattr(effect, "idempotency_key", None)
    return str(key) if key else str(effect.effect_id)
