"""`pginbox doctor`: reads a deployment and says, in plain words, what is wrong and what to run.

Each check returns Findings: a severity (problem, warning, ok), what it found, and what to do.
Everything it reads is open to inbox_reader (and inbox_operator); a check the role may not run is
reported as not checked, never as passed. Exit codes (for cron and CI): 0 nothing found, 1 only
warnings, 2 at least one problem (docs/operations.md).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

__all__ = ["OK", "PROBLEM", "WARNING", "Finding", "Report", "diagnose"]

PROBLEM: Final = "problem"
WARNING: Final = "warning"
OK: Final = "ok"
NOT_CHECKED: Final = "not checked"

Row = dict[str, Any]


@dataclass
class Finding:
    check: str
    severity: str
    message: str
    fix: str | None = None
    details: list[Row] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding]
    #: The first privilege error of a check this role may not run (a check not run is a warning).
    denied: psycopg.Error | None = None

    @property
    def problems(self) -> int:
        return sum(f.severity == PROBLEM for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.severity in (WARNING, NOT_CHECKED) for f in self.findings)

    @property
    def nothing_checked(self) -> bool:
        return all(f.severity == NOT_CHECKED for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 2 if self.problems else 1 if self.warnings else 0


UNBOUND_CONSUMERS: Final = """
SELECT c.consumer
  FROM (SELECT consumer FROM inbox.consumer_config
        UNION SELECT consumer FROM inbox.handler_registration) c
 WHERE NOT EXISTS (SELECT FROM inbox.consumer_binding b WHERE b.consumer = c.consumer)
 ORDER BY 1
"""
LEGACY_BINDINGS: Final = """
SELECT b.consumer, coalesce(r.rolname::text, b.role::text) AS role, b.bound_at
  FROM inbox.consumer_binding b LEFT JOIN pg_catalog.pg_roles r ON r.oid = b.role
 WHERE b.legacy
 ORDER BY 1
"""
# Destinations an operator configured, or effects wait for, that no consumer may enqueue to.
UNBOUND_DESTINATIONS: Final = """
SELECT d.destination
  FROM (SELECT destination FROM inbox.outbox_destination
        UNION SELECT DISTINCT destination FROM inbox.outbox WHERE status IN ('pending', 'leased')) d
 WHERE NOT EXISTS (SELECT FROM inbox.destination_binding b WHERE b.destination = d.destination)
 ORDER BY 1
"""
# Effects waiting without spending attempts, by destination and reason (inbox.defer_effects).
DEFERRED: Final = """
SELECT destination, deferred_reason AS reason, count(*) AS effects, max(deferrals) AS most_deferrals,
       now() - min(created_at) AS oldest_age
  FROM inbox.outbox
 WHERE status = 'pending' AND deferred_reason IS NOT NULL
   AND deferred_at >= coalesce(last_attempt_at, '-infinity')
 GROUP BY 1, 2
 ORDER BY 1, 2
"""
PENDING_DESTINATIONS: Final = """
SELECT destination, count(*) AS effects
  FROM inbox.outbox WHERE status IN ('pending', 'leased') GROUP BY 1 ORDER BY 1
"""
DEAD: Final = """
SELECT destination, dead_reason::text AS reason, count(*) AS effects
  FROM inbox.outbox WHERE status = 'dead' GROUP BY 1, 2 ORDER BY 1, 2
"""
# A window must hold its safety margin plus the clock tolerance (the margin, at least 5 minutes):
# set_retention_policy refuses such a policy since 0.3.0, an older one may still be there.
RETENTION_MARGIN: Final = """
SELECT p.consumer, p.producer, s.retention_window, p.safety_margin
  FROM inbox.retention_policy p
  JOIN inbox.retention_status s ON s.consumer = p.consumer AND s.producer = p.producer
 WHERE s.retention_window - p.safety_margin < greatest(p.safety_margin, interval '5 minutes')
 ORDER BY 1, 2
"""
PURGES: Final = """
SELECT s.consumer, s.producer, s.last_purge_at, s.purge_lag, now() - s.last_purge_at AS since_purge
  FROM inbox.retention_status s
 ORDER BY 1, 2
"""
OPEN_QUARANTINE: Final = """
SELECT consumer, count(*) AS entries FROM inbox.quarantine WHERE status = 'open' GROUP BY 1 ORDER BY 1
"""


def _names(rows: Iterable[Row], key: str) -> str:
    values = [str(r[key]) for r in rows]
    shown = ", ".join(repr(v) for v in values[:10])
    return shown + (f" and {len(values) - 10} more" if len(values) > 10 else "")


def _interval(value: datetime.timedelta | None) -> str:
    if value is None:
        return "-"
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _consumers(rows: list[Row]) -> Finding:
    if not rows:
        return Finding("consumers", OK, "every consumer with a handler or a configuration is bound to a role")
    return Finding(
        "consumers",
        WARNING,
        f"{len(rows)} consumer(s) nobody is bound to: {_names(rows, 'consumer')} — no service may claim for "
        "them (and with strict_consumers off, any inbox_consumer may)",
        "SELECT inbox.bind_consumer('<consumer>', '<service role>', note => '...')  (docs/security.md)",
        rows,
    )


def _legacy(rows: list[Row]) -> Finding:
    if not rows:
        return Finding("legacy bindings", OK, "no legacy binding is left from the 0.1.0 upgrade")
    return Finding(
        "legacy bindings",
        WARNING,
        f"{len(rows)} legacy binding(s) left by the upgrade from 0.1.0 ({_names(rows, 'consumer')}): every member "
        "of inbox_consumer may still act as these consumers",
        "bind each consumer to its own service role, then SELECT inbox.unbind_consumer('<consumer>', "
        "'inbox_consumer', 'tighten after the upgrade')  (docs/security.md, Upgrading from 0.1.0)",
        rows,
    )


def _destinations(
    unbound: list[Row], deferred: list[Row], pending: list[Row], configured: set[str] | None
) -> list[Finding]:
    out: list[Finding] = []
    if unbound:
        out.append(
            Finding(
                "destination bindings",
                WARNING,
                f"{len(unbound)} destination(s) no consumer is bound to: {_names(unbound, 'destination')} — every "
                "enqueue_effect to them is refused",
                "SELECT inbox.bind_destination('<destination>', '<consumer>', 'why')  (docs/outbox.md)",
                unbound,
            )
        )
    else:
        out.append(Finding("destination bindings", OK, "every destination in use has a consumer bound to it"))
    no_transport = [r for r in deferred if r["reason"] == "no_transport"]
    not_routed = [r for r in deferred if r["reason"] != "no_transport"]
    if no_transport:
        detail = "; ".join(
            f"{r['destination']!r}: {r['effects']} effect(s), oldest {_interval(r['oldest_age'])}" for r in no_transport
        )
        out.append(
            Finding(
                "dispatcher configuration",
                PROBLEM,
                f"no dispatcher has a transport for {len(no_transport)} destination(s) ({detail}); the effects wait, "
                "no attempt spent",
                "add the destination to the dispatcher's --config (or --callable), then `kill -HUP <dispatcher pid>`",
                no_transport,
            )
        )
    if configured is not None:
        missing = [
            r
            for r in pending
            if r["destination"] not in configured and r["destination"] not in {x["destination"] for x in no_transport}
        ]
        if missing:
            out.append(
                Finding(
                    "dispatcher configuration",
                    PROBLEM,
                    f"effects wait for destination(s) the given configuration does not have: "
                    f"{_names(missing, 'destination')}",
                    "add them to the configuration, then `kill -HUP <dispatcher pid>`",
                    missing,
                )
            )
    if not no_transport and (configured is None or not any(r["destination"] not in configured for r in pending)):
        out.append(
            Finding(
                "dispatcher configuration",
                OK,
                "no effect waits for a destination without a transport"
                + ("" if configured is not None else " (pass --config FILE to check a configuration)"),
            )
        )
    if not_routed:
        detail = "; ".join(
            f"{r['destination']!r} {r['reason']}: {r['effects']} effect(s), oldest {_interval(r['oldest_age'])}"
            for r in not_routed
        )
        out.append(
            Finding(
                "broker routing",
                WARNING,
                f"the broker cannot route effects yet ({detail}); they wait, no attempt spent",
                "declare the queue or stream: `pginbox outbox provision --config FILE`, or deploy the consuming "
                "service",
                not_routed,
            )
        )
    else:
        out.append(Finding("broker routing", OK, "no effect waits for a queue or stream"))
    return out


def _dead(rows: list[Row]) -> Finding:
    if not rows:
        return Finding("dead effects", OK, "no dead effect")
    by_destination: dict[str, list[str]] = {}
    for r in rows:
        by_destination.setdefault(str(r["destination"]), []).append(f"{r['reason']} {r['effects']}")
    total = sum(int(r["effects"]) for r in rows)
    detail = "; ".join(f"{d!r}: {', '.join(parts)}" for d, parts in by_destination.items())
    first = next(iter(by_destination))
    return Finding(
        "dead effects",
        PROBLEM,
        f"{total} dead effect(s), never delivered ({detail})",
        f"see `pginbox outbox list --status dead --destination {first}`, fix the cause, then "
        f"`pginbox outbox redrive --destination {first} --note '...'` (or discard them)",
        rows,
    )


def _margin(rows: list[Row]) -> Finding:
    if not rows:
        return Finding("retention margin", OK, "every retention window holds its safety margin and the clock tolerance")
    detail = "; ".join(
        f"{r['consumer']}/{r['producer'] or '*'}: window {_interval(r['retention_window'])}, margin "
        f"{_interval(r['safety_margin'])}"
        for r in rows
    )
    return Finding(
        "retention margin",
        PROBLEM,
        f"{len(rows)} retention window(s) cannot hold their safety margin ({detail}): a delivery within the clock "
        "tolerance may be purged and applied again",
        "`pginbox retention set <consumer> ...` with a window longer than twice the margin (docs/retention.md)",
        rows,
    )


def _purges(rows: list[Row], stale_after: datetime.timedelta) -> Finding:
    never = [r for r in rows if r["last_purge_at"] is None]
    stale = [r for r in rows if r["since_purge"] is not None and r["since_purge"] > stale_after]
    if not rows:
        return Finding("purge", OK, "no retention policy: nothing is ever purged (nothing to run)")
    if not never and not stale:
        return Finding("purge", OK, f"every policy was purged within {_interval(stale_after)}")
    parts = []
    if never:
        parts.append(f"never purged: {_names(never, 'consumer')}")
    if stale:
        parts.append(
            "last purged long ago: " + ", ".join(f"{r['consumer']!r} {_interval(r['since_purge'])} ago" for r in stale)
        )
    return Finding(
        "purge",
        WARNING,
        f"the purge has not run ({'; '.join(parts)})",
        "run `pginbox purge` from cron, or `pginbox dispatch --purge-every 3600`",
        never + stale,
    )


def _quarantine(rows: list[Row]) -> Finding:
    if not rows:
        return Finding("quarantine", OK, "no open quarantine entry")
    total = sum(int(r["entries"]) for r in rows)
    return Finding(
        "quarantine",
        WARNING,
        f"{total} open quarantine entr{'y' if total == 1 else 'ies'} ({_names(rows, 'consumer')})",
        "`pginbox quarantine list`, then repair, release or discard each",
        rows,
    )


#: Does every expected standby have the WAL written up to now, within the allowed lag? The same
#: SECURITY DEFINER wait `pginbox consume --durability standby` uses (docs/failover.md): open to
#: inbox_operator, inbox_consumer and inbox_dispatcher without any monitoring right.
STANDBYS_CAUGHT_UP: Final = "SELECT inbox.wait_durable(NULL, %s, 'flush', NULL, %s) AS caught_up"
# Only the walsenders' count: their other columns are NULL for a role without pg_read_all_stats.
STANDBYS_CONNECTED: Final = "SELECT count(*) AS connected FROM pg_catalog.pg_stat_replication"


def _standbys(caught_up: bool, streaming: int, expected: int, lag: datetime.timedelta) -> Finding:
    if caught_up:
        return Finding(
            "standbys",
            OK,
            f"{expected} standby(s) flushed the primary's WAL within {lag.total_seconds():g} s "
            f"({streaming} connected): an ack after `--durability standby` is not held back",
        )
    return Finding(
        "standbys",
        PROBLEM,
        f"fewer than {expected} standby(s) flushed the primary's WAL within {lag.total_seconds():g} s "
        f"({streaming} connected): consumers with `--durability standby` hand their batches back, and a "
        "failover now would lose what was committed since",
        "check the standbys (`SELECT * FROM pg_stat_replication` as a monitoring role: state, flush_lag), "
        "their network and disks; docs/failover.md",
        [{"expected": expected, "connected": streaming}],
    )


def diagnose(
    conn: psycopg.Connection[Any],
    *,
    configured: set[str] | None = None,
    purge_stale_after: datetime.timedelta = datetime.timedelta(days=1),
    standbys: int = 0,
    standby_lag: datetime.timedelta = datetime.timedelta(seconds=5),
) -> Report:
    """Every check, in a fixed order; a check the role may not run is reported as not checked."""
    findings: list[Finding] = []
    denied: list[psycopg.Error] = []

    def rows(query: str, params: tuple[Any, ...] | None = None) -> list[Row]:
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query, params).fetchall()

    def check(name: str, run: Callable[[], Finding | list[Finding]]) -> None:
        try:
            with conn.transaction():
                found = run()
        except psycopg.errors.InsufficientPrivilege as exc:
            denied.append(exc)
            primary = exc.diag.message_primary or str(exc)
            findings.append(
                Finding(
                    name, NOT_CHECKED, f"not checked: {primary} (connect as a member of inbox_reader or inbox_operator)"
                )
            )
            return
        findings.extend(found if isinstance(found, list) else [found])

    check("consumers", lambda: _consumers(rows(UNBOUND_CONSUMERS)))
    check("legacy bindings", lambda: _legacy(rows(LEGACY_BINDINGS)))
    check(
        "destinations",
        lambda: _destinations(rows(UNBOUND_DESTINATIONS), rows(DEFERRED), rows(PENDING_DESTINATIONS), configured),
    )
    check("dead effects", lambda: _dead(rows(DEAD)))
    check("retention margin", lambda: _margin(rows(RETENTION_MARGIN)))
    check("purge", lambda: _purges(rows(PURGES), purge_stale_after))
    check("quarantine", lambda: _quarantine(rows(OPEN_QUARANTINE)))
    if standbys > 0:
        check(
            "standbys",
            lambda: _standbys(
                bool(rows(STANDBYS_CAUGHT_UP, (standbys, standby_lag))[0]["caught_up"]),
                int(rows(STANDBYS_CONNECTED)[0]["connected"]),
                standbys,
                standby_lag,
            ),
        )
    return Report(findings, denied[0] if denied else None)
