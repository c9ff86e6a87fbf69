"""`pginbox demo`: the four acts of pginbox.demo against the DSN."""

from __future__ import annotations

import click

from pginbox.cli.context import database, dsn_option

__all__ = ["demo"]


@click.command()
@dsn_option
@click.option(
    "--messages",
    type=click.IntRange(10, 1_000_000),
    default=3000,
    show_default=True,
    help="Messages the producer sends in the simulation.",
)
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Consumer threads.")
@click.option("--seed", type=int, default=None, help="Seed of the fault injection [default: random, printed].")
@click.option(
    "--act",
    "acts",
    type=click.IntRange(1, 4),
    multiple=True,
    help="Run only this act (repeatable): 1 every outcome, 2 the simulation, 3 the outbox, 4 the broker "
    "chain (RabbitMQ, NATS JetStream; skipped when unreachable) [default: all].",
)
@click.option(
    "--outbox-messages",
    type=click.IntRange(10, 100_000),
    default=200,
    show_default=True,
    help="Act 3: messages whose handlers enqueue effects.",
)
@click.option(
    "--sink-no-dedup",
    is_flag=True,
    help="Act 3: the HTTP sink does not deduplicate on Idempotency-Key (see why it must: the proof fails).",
)
@click.pass_context
def demo(
    ctx: click.Context,
    command_dsn: str | None,
    messages: int,
    workers: int,
    seed: int | None,
    acts: tuple[int, ...],
    outbox_messages: int,
    sink_no_dedup: bool,
) -> None:
    """Walk through every outcome, simulate at-least-once delivery with faults and prove that no
    message was applied twice, then deliver outbox effects to a flaky HTTP sink and prove each was
    sent with one stable key and counted once (exit status 1 if anything is violated)."""
    from pginbox import demo as demo_module

    demo_module.run(
        database(ctx, command_dsn, demo_cluster=True),
        messages=messages,
        workers=workers,
        seed=seed,
        acts=acts or (1, 2, 3, 4),
        outbox_messages=outbox_messages,
        sink_dedup=not sink_no_dedup,
    )
