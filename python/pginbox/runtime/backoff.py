"""Every backoff of pginbox, written once: capped exponential steps (base, 2 x base, ... up to cap).

jittered(failures, base, cap)  capped exponential backoff with "equal jitter": base, 2 x base, ...
                               up to cap, each drawn from 50..100% of the step (reconnects, the
                               consumer's pause while the database is down, failed claims)
full_jitter(retry, base, cap)  uniform in [0, step] ("full jitter"): the clients' RetryPolicy
                               between attempts of a transaction, and while resolving a lost COMMIT
doubling(attempt, base, cap)   the delay before a FAILED message comes back: base, 2 x base, ...
                               up to cap, not jittered (the broker holds it that long)
"""

from __future__ import annotations

import random

__all__ = ["doubling", "full_jitter", "jittered"]


def _step(n: int, base: float, cap: float) -> float:
    return float(min(cap, base * 2.0 ** min(max(n - 1, 0), 40)))


def jittered(failures: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after `failures` failures in a row (1 for the first)."""
    return _step(failures, base, cap) * (rng or random).uniform(0.5, 1.0)


def full_jitter(retry: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to sleep before retry number `retry` (1 for the first)."""
    return (rng or random).uniform(0.0, _step(retry, base, cap))


def doubling(attempt: int | None, base: float, cap: float) -> float:
    """Seconds before attempt `attempt` + 1 of a failed message (attempt 1: `base`)."""
    return _step(attempt or 1, base, cap)
