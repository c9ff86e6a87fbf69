"""`pginbox dispatch` (the outbox dispatcher daemon) and `pginbox dispatch-health`."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click
import psycopg

from pginbox.cli.context import SHARD_DSN, State, database, dsn_option, mask_dsn
from pginbox.ops.retention import PeriodicPurger
from pginbox.sql_limits import CLAIM_LIMIT, LEASE_MAX_SECONDS

if TYPE_CHECKING:  # imported when the command runs: the other commands start without httpx & co.
    from pginbox.dispatcher import Dispatcher
    from pginbox.transports import Transport

__all__ = ["dispatch", "dispatch_health"]


def _load_callable(spec: str) -> tuple[str, Callable[..., object]]:
    """`destination=module:function` -> (destination, the function)."""
    from pginbox.runtime.loading import load_object

    destination, sep, target = spec.partition("=")
    if not sep or not destination:
        raise click.BadParameter(f"expected destination=module:function, got {spec!r}", param_hint="--callable")
    try:
        found = load_object(target, spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--callable") from None
    return destination, cast(Callable[..., object], found)


def _transports(config: Path | None, callables: tuple[str, ...]) -> dict[str, Transport]:
    """The destinations: pginbox.transports.load_config (TOML file, environment, entry points),
    then each --callable."""
    from pginbox.transports import CallableTransport, load_config

    transports = dict(load_config(config))
    for spec in callables:
        destination, func = _load_callable(spec)
        transports[destination] = CallableTransport(func)
    if not transports:
        raise click.UsageError("no destinations: pass --callable DEST=MODULE:FUNCTION or --config FILE")
    return transports


class _Destinations:
    """The dispatcher's destinations, read again on SIGHUP (--config, the environment, entry
    points, --callable). Every transport ever built is closed at exit: one replaced by a reload
    may still be finishing a delivery."""

    def __init__(self, config: Path | None, callables: tuple[str, ...]) -> None:
        self.config = config
        self.callables = callables
        self.current = _transports(config, callables)
        self.built: list[Transport] = list(self.current.values())

    def reload(self, dispatcher: Dispatcher) -> None:
        log = logging.getLogger("pginbox.dispatcher")
        try:
            fresh = _transports(self.config, self.callables)
        except Exception as exc:  # a broken file must not stop a running dispatcher
            log.error(
                f"reload_failed dispatcher={dispatcher.name} error={type(exc).__name__}: {exc} "
                "(the destinations stay as they were)"
            )
            return
        added = sorted(set(fresh) - set(self.current))
        removed = sorted(set(self.current) - set(fresh))
        self.current = fresh
        self.built.extend(fresh.values())
        dispatcher.replace_transports(fresh)
        log.info(
            f"reloaded dispatcher={dispatcher.name} destinations={','.join(sorted(fresh))} "
            f"added={','.join(added) or '-'} removed={','.join(removed) or '-'}"
        )

    def close(self) -> None:
        _close_transports(self.built)


@contextmanager
def _stopped_by_signals(dispatcher: Dispatcher, destinations: _Destinations | None = None) -> Iterator[None]:
    """SIGTERM and SIGINT stop the dispatcher (it finishes what is in flight); SIGHUP reloads its
    destinations (in a thread: a reload may connect to brokers), leases kept. The previous
    handlers come back afterwards."""

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger("pginbox.dispatcher").info(f"stopping signal={signal.Signals(signum).name}")
        dispatcher.stop()

    def on_hangup(signum: int, frame: object) -> None:
        if destinations is not None:
            threading.Thread(target=destinations.reload, args=(dispatcher,), name="reload", daemon=True).start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hangup)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: `dispatch --once` exits with this status when effects went dead during the run (cron can tell).
EXIT_EFFECTS_DEAD = 3

_DEAD_EFFECTS = "SELECT effect_id, consumer, attempts FROM inbox.outbox WHERE status = 'dead'"


def _dead_effects(dsn: str) -> set[tuple[str, str, int]] | None:
    """The dead effects now, as (effect_id, consumer, attempts); None when this role may not read
    them (then only the deaths this dispatcher reported itself are counted)."""
    try:
        with psycopg.connect(dsn, autocommit=True, application_name="pginbox-dispatch") as conn:
            return {(str(a), str(b), int(c)) for a, b, c in conn.execute(_DEAD_EFFECTS).fetchall()}
    except psycopg.errors.InsufficientPrivilege:
        return None


def _died_during_run(
    before: set[tuple[str, str, int]] | None, after: set[tuple[str, str, int]] | None, reported: int
) -> int:
    """How many effects went dead during this run: those dead now that were not dead (with the same
    attempts) before it, which includes effects whose last lease expired (turned dead by a claim,
    not by a report); at least the dead reports of this dispatcher."""
    if before is None or after is None:
        return reported
    return max(len(after - before), reported)


def _run(dispatcher: Dispatcher, purger: PeriodicPurger | None, *, once: bool) -> None:
    """--once: drain what is due (then purge once); else the daemon loop, the purger beside it."""
    if once:
        # A ClaimError (claims kept failing: --once did not drain) goes to the CLI's error handler,
        # which adds what the database said and, for a missing grant, the group role needed.
        dispatcher.run_once()
        if purger is not None:
            purger.run_once()
        return
    if purger is not None:
        purger.start()
    dispatcher.run()


@click.command()
@dsn_option
@click.option(
    "--listen-dsn",
    default=None,
    metavar="DSN",
    help="A direct connection (not through PgBouncer) for LISTEN, and for --purge-every; "
    "the claims use --dsn. Behind a pooler without it the dispatcher polls (see /healthz).",
)
@click.option("--once", is_flag=True, help="Deliver everything due, then exit (for cron and tests).")
@click.option("--name", default=None, help="Dispatcher name (unique per process) [default: pginbox-<host>-<pid>].")
@click.option("--batch-size", type=click.IntRange(1, CLAIM_LIMIT), default=100, show_default=True)
@click.option(
    "--lease", type=click.FloatRange(0.001, LEASE_MAX_SECONDS), default=30.0, show_default=True, help="Lease, seconds."
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1000),
    default=8,
    show_default=True,
    help="In-flight deliveries per destination.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(0.01, 3600),
    default=1.0,
    show_default=True,
    help="Longest wait between claims when idle (the NOTIFY signal usually comes first), seconds.",
)
@click.option(
    "--delivery-timeout",
    type=click.FloatRange(0.001, 86400),
    default=None,
    help="A delivery running longer is reported as an ambiguous, retryable failure, seconds.",
)
@click.option(
    "--callable",
    "callables",
    multiple=True,
    metavar="DEST=MODULE:FUNCTION",
    help="Deliver destination DEST by calling MODULE:FUNCTION(effect) (repeatable).",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML file of destinations (pginbox.transports).",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve GET /healthz and GET /metrics (Prometheus) on this port (0: any free port, logged).",
)
@click.option(
    "--health-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the health endpoint binds to (it has no authentication).",
)
@click.option(
    "--purge-every",
    type=click.FloatRange(1, 86400 * 7),
    default=None,
    metavar="SECONDS",
    help="Also purge every consumer with a retention policy this often (with --once: once, at the end).",
)
@click.option(
    "--database-metrics",
    is_flag=True,
    default=False,
    help="Also serve inbox.metrics() at the health endpoint's /metrics (the role needs inbox_reader).",
)
@click.option(
    "--defer-after",
    type=click.FloatRange(1, 3600),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="An effect whose destination is not ready (no transport configured, the broker cannot route "
    "yet) waits this long, no attempt spent, before it is tried again.",
)
@click.option(
    "--keep-delivered",
    type=click.FloatRange(0, None),
    default=7 * 86400.0,
    show_default=True,
    metavar="SECONDS",
    help="With --purge-every: also delete delivered and discarded effects older than this, in batches.",
)
@click.option(
    "--shard-dsn",
    "shard_dsns",
    multiple=True,
    type=SHARD_DSN,
    metavar="DSN",
    help="Serve these shard databases from this process instead of --dsn (repeatable; docs/scaling.md): "
    "one dispatcher per shard, each with at most min(max(batch-size, concurrency), 16) + 2 "
    "connections to its shard.",
)
@click.pass_context
def dispatch(
    ctx: click.Context,
    command_dsn: str | None,
    listen_dsn: str | None,
    once: bool,
    name: str | None,
    batch_size: int,
    lease: float,
    concurrency: int,
    poll_interval: float,
    delivery_timeout: float | None,
    callables: tuple[str, ...],
    config: Path | None,
    health_port: int | None,
    health_host: str,
    purge_every: float | None,
    database_metrics: bool,
    defer_after: float,
    keep_delivered: float,
    shard_dsns: tuple[str, ...],
) -> None:
    """Deliver committed outbox effects to their destinations (SIGTERM/SIGINT: finish and exit 0;
    SIGHUP: read the destinations again, leases kept).
    With --once: exit status 3, and the count on stderr, when effects went dead during the run
    (also those whose last lease expired, when the role can read inbox.outbox)."""
    state = ctx.find_object(State)
    run = _RunSettings(
        once=once,
        name=name or f"pginbox-{socket.gethostname()}-{os.getpid()}",
        verbose=state is not None and state.verbose,
        dispatcher={
            "batch_size": batch_size,
            "lease": lease,
            "concurrency_per_destination": concurrency,
            "poll_interval": poll_interval,
            "delivery_timeout": delivery_timeout,
            "defer_after": defer_after,
        },
        purge_every=purge_every,
        keep_delivered=datetime.timedelta(seconds=keep_delivered),
    )
    if shard_dsns:
        for flag, value in (
            ("--health-port", health_port),
            ("--listen-dsn", listen_dsn),
            ("--database-metrics", database_metrics or None),
        ):
            if value is not None:
                raise click.UsageError(
                    f"{flag} serves one database: with --shard-dsn, run one process per shard for it (docs/scaling.md)"
                )
        transports = _transports(config, callables)
        run.configure_logging()
        _dispatch_shards(run, [database(ctx, shard_dsn) for shard_dsn in shard_dsns], transports)
        return

    from pginbox.dispatcher import HealthServer
    from pginbox.ops.metrics import DatabaseCollector

    dsn = database(ctx, command_dsn)
    destinations = _Destinations(config, callables)
    run.configure_logging()
    dispatcher = run.new_dispatcher(
        dsn,
        run.name,
        destinations.current,
        extra_collectors=[DatabaseCollector(dsn)] if database_metrics else (),
        listen_dsn=listen_dsn,
    )
    purger = run.new_purger(listen_dsn or dsn)
    health = None
    dead_before = _dead_effects(dsn) if once else None
    with _stopped_by_signals(dispatcher, destinations):
        try:
            if health_port is not None:
                health = HealthServer(dispatcher, health_host, health_port).start()
            _run(dispatcher, purger, once=once)
        finally:
            if purger is not None:
                purger.stop()
            if health is not None:
                health.close()
            dispatcher.close()
            destinations.close()
    _echo_stats(dispatcher.stats.as_dict())
    deferring = dispatcher.stats.deferring_now()
    if once and deferring:
        waiting = ", ".join(f"{destination} ({reason})" for destination, reason in deferring.items())
        click.echo(
            f"pginbox dispatch: effects wait, no attempt spent, for destinations not ready: {waiting}; "
            "see `pginbox doctor` (a transport to configure, a queue or stream to provision)",
            err=True,
        )
    if once:
        died = _died_during_run(
            dead_before, _dead_effects(dsn) if dead_before is not None else None, dispatcher.stats.dead
        )
        _exit_if_died(died, "see `pginbox outbox list --status dead`, then redrive or discard them")


@dataclass(frozen=True)
class _RunSettings:
    """What `dispatch` was asked for, shared by the single-database run and the one over shards."""

    once: bool
    name: str
    verbose: bool
    dispatcher: dict[str, Any]  # Dispatcher keyword arguments every dispatcher of the run takes
    purge_every: float | None
    keep_delivered: datetime.timedelta

    def configure_logging(self) -> None:
        logging.basicConfig(
            level=logging.DEBUG if self.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )

    def new_dispatcher(self, dsn: str, name: str, transports: dict[str, Transport], **more: Any) -> Dispatcher:
        from pginbox.dispatcher import Dispatcher

        return Dispatcher(dsn, name, transports, **self.dispatcher, **more)

    def new_purger(self, dsn: str) -> PeriodicPurger | None:
        """--purge-every: a purger of `dsn` beside the dispatcher."""
        if self.purge_every is None:
            return None
        return PeriodicPurger(dsn, self.purge_every, keep_delivered=self.keep_delivered)


def _dispatch_shards(run: _RunSettings, shards: list[str], transports: dict[str, Transport]) -> None:
    """`dispatch --shard-dsn ...`: one dispatcher (and purger) per shard in this process."""
    dispatchers = [run.new_dispatcher(dsn, f"{run.name}-shard{i}", transports) for i, dsn in enumerate(shards)]
    purgers = [run.new_purger(dsn) for dsn in shards]
    try:
        failures = _run_shards(dispatchers, purgers, once=run.once)
    finally:
        for purger in purgers:
            if purger is not None:
                purger.stop()
        for one in dispatchers:
            one.close()
        _close_transports(transports.values())
    for dsn, one in zip(shards, dispatchers, strict=True):
        _echo_stats(one.stats.as_dict(), prefix=f"shard={mask_dsn(dsn)} ")
    if failures:
        raise click.ClickException("; ".join(failures))
    if run.once:
        _exit_if_died(
            sum(one.stats.dead for one in dispatchers), "see `pginbox outbox list --status dead` on each shard"
        )


def _echo_stats(stats: dict[str, object], prefix: str = "") -> None:
    click.echo(prefix + " ".join(f"{k}={'-' if v is None else v}" for k, v in stats.items()))


def _exit_if_died(died: int, advice: str) -> None:
    """--once: exit with EXIT_EFFECTS_DEAD, saying how many and what to do, when effects went dead."""
    if died:
        click.echo(
            f"pginbox dispatch: {died} effect{'s' if died != 1 else ''} went dead during this run; {advice}", err=True
        )
        raise click.exceptions.Exit(EXIT_EFFECTS_DEAD)


def _close_transports(transports: Iterable[Transport]) -> None:
    for transport in transports:  # the broker transports hold connections and a loop
        close = getattr(transport, "close", None)
        if callable(close):
            close()


class _All:
    """Stops every shard's dispatcher (what the signal handler is given)."""

    def __init__(self, dispatchers: list[Dispatcher]) -> None:
        self.dispatchers = dispatchers

    def stop(self) -> None:
        for one in self.dispatchers:
            one.stop()


def _run_shards(dispatchers: list[Dispatcher], purgers: list[PeriodicPurger | None], *, once: bool) -> list[str]:
    """Each shard's dispatcher (and purger) on a thread of its own until all are done (--once) or
    stopped by a signal; a shard whose claims keep failing is reported, the others go on. Returns
    the failures, one line per shard."""
    import threading

    failures: list[str] = []

    def work(one: Dispatcher, purger: PeriodicPurger | None) -> None:
        try:
            _run(one, purger, once=once)
        except click.ClickException as exc:
            failures.append(f"{one.name}: {exc.message}")
        except Exception as exc:  # reported below; the other shards go on
            failures.append(f"{one.name}: {exc}")

    threads = [
        threading.Thread(target=work, args=(one, purger), name=f"shard-{one.name}", daemon=True)
        for one, purger in zip(dispatchers, purgers, strict=True)
    ]
    with _stopped_by_signals(cast("Dispatcher", _All(dispatchers))):
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # a short wait: the signal handler runs on this thread
    return failures


@click.command(name="dispatch-health")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="The dispatcher's --health-port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --port: the dispatcher's --health-host.")
@click.option("--url", default=None, help="Full URL instead [default: http://HOST:PORT/healthz].")
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=5.0, show_default=True, help="Seconds.")
def dispatch_health(port: int | None, host: str, url: str | None, timeout: float) -> None:
    """Ask a running `pginbox dispatch --health-port` whether it is healthy: prints its JSON;
    exit status 0 when healthy, 1 when not (503) or unreachable."""
    if url is None:
        if port is None:
            raise click.UsageError("pass --port PORT (the dispatcher's --health-port) or --url URL")
        url = f"http://{host}:{port}/healthz"
    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--url must be http(s)://..., got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"{url}: unreachable: {getattr(exc, 'reason', exc)}") from None
    click.echo(body.decode("utf-8", errors="replace").rstrip())
    if status != 200:
        raise click.exceptions.Exit(1)
