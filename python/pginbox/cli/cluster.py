"""`pginbox cluster start | stop | status | dsn`: the private PostgreSQL cluster of the demo."""

from __future__ import annotations

from pathlib import Path

import click

from pginbox.devtools.cluster import Cluster, StopMode, default_cluster

__all__ = ["cluster_group"]


@click.group(name="cluster")
@click.option(
    "--datadir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="PGINBOX_CLUSTER_DIR",
    help="Data directory [default: <checkout>/.pginbox/cluster].",
)
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port to use.")
@click.pass_context
def cluster_group(ctx: click.Context, datadir: Path | None, port: int | None) -> None:
    """The private PostgreSQL cluster used by the demo (127.0.0.1, trust auth)."""
    if datadir is None:
        datadir = default_cluster().datadir
    ctx.meta["pginbox.cluster"] = Cluster(datadir, port)


def _cluster(ctx: click.Context) -> Cluster:
    found = ctx.meta["pginbox.cluster"]
    assert isinstance(found, Cluster)
    return found


@cluster_group.command(name="start")
@click.pass_context
def cluster_start(ctx: click.Context) -> None:
    """Create the cluster if needed and start it."""
    cluster = _cluster(ctx)
    cluster.start()
    click.echo(f"running: {cluster.dsn()}  (data directory {cluster.datadir})")


@cluster_group.command(name="stop")
@click.option(
    "--mode",
    type=click.Choice(["smart", "fast", "immediate"]),
    default="fast",
    show_default=True,
)
@click.pass_context
def cluster_stop(ctx: click.Context, mode: StopMode) -> None:
    """Stop the cluster."""
    cluster = _cluster(ctx)
    cluster.stop(mode)
    click.echo(f"stopped: {cluster.datadir}")


@cluster_group.command(name="status")
@click.pass_context
def cluster_status(ctx: click.Context) -> None:
    """Show whether the cluster runs (exit status 3 when it does not)."""
    cluster = _cluster(ctx)
    if not cluster.is_initialized():
        click.echo(f"not created: {cluster.datadir}")
        ctx.exit(3)
    if cluster.is_running():
        click.echo(f"running: {cluster.dsn()}  (data directory {cluster.datadir})")
        return
    click.echo(f"stopped: {cluster.datadir}")
    ctx.exit(3)


@cluster_group.command(name="dsn")
@click.option("--dbname", default="postgres", show_default=True)
@click.option("--no-dbname", is_flag=True, help="Leave the database name out.")
@click.pass_context
def cluster_dsn(ctx: click.Context, dbname: str, no_dbname: bool) -> None:
    """Print the connection string of the cluster (it must have been created)."""
    cluster = _cluster(ctx)
    click.echo(cluster.dsn_base() if no_dbname else cluster.dsn(dbname))
