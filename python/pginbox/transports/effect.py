"""`Effect`: one effect of the outbox, as inbox.claim_effects returns it (the dispatcher claims
them; transports deliver them). `effect_id` is the idempotency key of every attempt."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Effect", "EffectLike"]


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


class EffectLike(Protocol):
    """What a transport reads from an effect (Effect has it, and so may a caller's own type)."""

    @property
    def effect_id(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
