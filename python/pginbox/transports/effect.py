"""`Effect`: one effect of the outbox, as inbox.claim_effects returns it (the dispatcher claims
them; transports deliver them). Every attempt carries the same key, `delivery_key(effect)`: the
`idempotency_key` claim_effects returns (since 0.3.0 derived from consumer, tenant and effect id,
so that two consumers sharing a destination never send each other's key), else the effect id."""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Effect", "EffectLike", "delivery_key", "idempotency_key"]


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


def idempotency_key(consumer: str, tenant: str, effect_id: str) -> str:
    """inbox.idempotency_key(consumer, tenant, effect_id), computed here: "ik_" and the hex SHA-256 of
    a version tag and the three parts, each prefixed with its length in bytes (4, big-endian). A
    destination can check a key against the effect it names; the SQL function is the reference
    (tests/python/integration/test_sql_contract.py compares the two)."""
    digest = hashlib.sha256(b"pginbox.idempotency_key.v1")
    for part in (consumer, tenant, effect_id):
        data = part.encode()
        digest.update(len(data).to_bytes(4, "big", signed=True))
        digest.update(data)
    return "ik_" + digest.hexdigest()
