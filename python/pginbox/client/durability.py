"""`Durability`: when a commit counts as done, so that a broker message may be acked (issue 24,
docs/failover.md).

    Durability()                                   "commit": COMMIT returned on the primary (the
                                                   default; right where there is no standby, or the
                                                   standbys are synchronous and PostgreSQL waits)
    Durability.standby()                           "standby": COMMIT returned, and at least one
    Durability.standby(2, names=("s1", "s2"),      standby (or N of the named ones) reports the WAL
                       wait="apply", timeout=5.0)  flushed (or replayed) up to the commit

The wait is inbox.wait_durable (sql/115_durability.sql), one statement after the last COMMIT of a
call: once per batch, not per message. It reads the standbys' positions as inbox_monitor (SECURITY DEFINER), so the
consumer's role needs no monitoring rights. A wait that times out (or loses the database) raises
NotDurable: the caller must not ack, and the redelivery is a duplicate once the commit is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["COMMIT", "STANDBY", "WAIT_DURABLE", "Durability"]

COMMIT: Final = "commit"
STANDBY: Final = "standby"

#: params: min_standbys, mode, standby_names (text[] or None), timeout (seconds)
WAIT_DURABLE: Final = "SELECT inbox.wait_durable(NULL, %s::integer, %s::text, %s::text[], %s * interval '1 second')"


@dataclass(frozen=True)
class Durability:
    mode: Literal["commit", "standby"] = COMMIT
    min_standbys: int = 1
    standby_names: tuple[str, ...] | None = None
    wait: Literal["flush", "apply"] = "flush"
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in (COMMIT, STANDBY):
            raise ValueError(f"durability mode {self.mode!r}: expected 'commit' or 'standby'")
        if not 1 <= self.min_standbys <= 64:
            raise ValueError(f"min_standbys={self.min_standbys!r}: must be between 1 and 64")
        if self.wait not in ("flush", "apply"):
            raise ValueError(f"standby wait {self.wait!r}: expected 'flush' or 'apply'")
        if not 0 <= self.timeout <= 3600:
            raise ValueError(f"durability timeout={self.timeout!r}: must be between 0 and 3600 seconds")
        if self.standby_names is not None and (
            not self.standby_names or any(not isinstance(n, str) or not n.strip() for n in self.standby_names)
        ):
            raise ValueError("standby_names: give the standbys' application names, or None for any standby")

    @classmethod
    def standby(
        cls,
        min_standbys: int = 1,
        *,
        names: tuple[str, ...] | list[str] | None = None,
        wait: Literal["flush", "apply"] = "flush",
        timeout: float = 10.0,
    ) -> Durability:
        return cls(STANDBY, min_standbys, None if names is None else tuple(names), wait, timeout)

    @property
    def waits(self) -> bool:
        """True when a call must wait for the standbys before it reports success."""
        return self.mode == STANDBY

    def params(self) -> tuple[Any, ...]:
        """The parameters of WAIT_DURABLE."""
        names = None if self.standby_names is None else list(self.standby_names)
        return (self.min_standbys, self.wait, names, self.timeout)

    def describe(self) -> str:
        if not self.waits:
            return COMMIT
        who = "any standby" if self.standby_names is None else "of " + ",".join(self.standby_names)
        return f"standby: {self.min_standbys} {who}, {self.wait}, timeout {self.timeout:g} s"
