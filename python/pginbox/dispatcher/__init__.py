"""The outbox dispatcher: claims committed effects, delivers them through a transport, reports.

    dispatcher.py   Dispatcher: the claim loop, the delivery lanes, leases and timeouts
    reporter.py     the reporter thread: set-based reports in batches
    listener.py     the LISTEN session (wake-up signal), reconnected with backoff
    (pginbox.runtime: HealthServer, kv lines, backoff; pginbox.brokers: broker destinations)
    stats.py        DispatcherStats and the Prometheus metrics
    queries.py      the statements it runs
    log.py          the `event key=value` log lines

    dispatcher = Dispatcher(dsn, "disp-1", {"crm": CallableTransport(send_to_crm)})
    dispatcher.run_once()      # drain what is due, then return (cron, tests)
    dispatcher.run()           # the daemon loop, until stop() (SIGTERM/SIGINT in the CLI)

It follows the wake-up protocol of docs/outbox.md §7: claim until a claim returns nothing; then
register idle (inbox.dispatcher_idle), claim once more (catch-up), and wait for a notification on
channel `inbox_outbox`, claiming after each wait, the waits growing from `settle` up to
`poll_interval` (polling stays behind the signal). The LISTEN connection is its own autocommit
session, reconnected with capped, jittered exponential backoff, followed by a catch-up claim; an
idle LISTEN connection is probed with SELECT 1. Claims and reports use a separate pool.

Every delivery carries the effect's `effect_id` as its idempotency key, on every attempt: an
exception from a transport is an ambiguous outcome (the destination may have acted) and is
reported as a retryable failure, so the retry carries the same key. Reports refused by fencing
(the lease expired and another dispatcher took the effect) are counted and dropped.

Claimed effects wait in a queue per destination, drained by at most `concurrency_per_destination`
delivery tasks (one executor task per free slot, not per effect). Finished deliveries put their
report on the report queue; one reporter thread flushes it every `report_batch` reports or
`report_interval` seconds, whichever comes first, with ONE statement (inbox.complete_effects and
inbox.fail_effects, one implicit transaction, one commit). An effect stays in flight (and its
lease is extended as needed) until its report is flushed; the flush interval is far below the
lease (at most lease / 10, enforced), so a queued report is recorded long before the lease ends.
close() (and so SIGTERM in the CLI) flushes the queue before it returns; if the process dies with
reports queued, those effects are redelivered with the same key once their leases expire (the
at-least-once contract). A claim that fails with a database error is retried with capped,
jittered exponential backoff; run_once() raises ClaimError after `claim_retries` failures in a row.

Observability: `dispatcher.health()` says whether the LISTEN session is up and the loop ran
recently; `dispatcher.registry` is a prometheus-client registry of its own with the counters
(pginbox_dispatcher_*: claimed, delivered, retried, dead, fenced_out by report, report errors,
LISTEN reconnects), the lag histogram (created_at -> delivery recorded) and the in-flight gauge;
more collectors can be registered on it (`extra_collectors=` or `dispatcher.registry.register`).
`HealthServer(dispatcher, host, port)` serves GET /healthz and GET /metrics (`pginbox dispatch
--health-port`). Every delivered, retried, dead and fenced report is logged (logger
pginbox.dispatcher) as one `event key=value ...` line with effect_id, destination, attempt and
duration_ms.
"""

from pginbox.dispatcher.dispatcher import Dispatcher
from pginbox.dispatcher.queries import CHANNEL
from pginbox.dispatcher.stats import DispatcherStats
from pginbox.errors import ClaimError
from pginbox.runtime.health import HealthServer
from pginbox.transports.callable import CallableTransport
from pginbox.transports.effect import Effect
from pginbox.transports.protocol import DeliveryReport, Transport, TransportResolver

__all__ = [
    "CHANNEL",
    "CallableTransport",
    "ClaimError",
    "DeliveryReport",
    "Dispatcher",
    "DispatcherStats",
    "Effect",
    "HealthServer",
    "Transport",
    "TransportResolver",
]
