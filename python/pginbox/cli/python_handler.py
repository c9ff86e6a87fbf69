"""What the commands that run a consumer's Python handler with its own login share (`pginbox
quarantine repair | redeem --python`, `pginbox replay create | run --python`): the --consume-config
option (the handler `pginbox consume`'s file names is the default of --python) and loading the
handler."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from pginbox.runtime.loading import load_object

__all__ = ["CONSUME_CONFIG_HELP", "configured_handler", "consume_config_option", "load_python_handler"]

F = TypeVar("F", bound=Callable[..., Any])

CONSUME_CONFIG_HELP = (
    "The TOML file `pginbox consume` runs with: its [consume] handler (and handler_version) is the "
    "default of --python (and --handler-version)."
)


def consume_config_option(help: str = CONSUME_CONFIG_HELP) -> Callable[[F], F]:
    """The --consume-config option (the parameter `consume_config`, a Path or None)."""
    return click.option(
        "--consume-config",
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        default=None,
        help=help,
    )


def _consume_handler(path: Path) -> tuple[str, str | None]:
    """The Python handler (and its version) the [consume] table of `pginbox consume`'s file names."""
    try:
        with path.open("rb") as fh:
            table = tomllib.load(fh).get("consume", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--consume-config") from None
    handler = table.get("handler") if isinstance(table, dict) else None
    if not isinstance(handler, str) or handler in ("", "sql"):
        raise click.BadParameter(
            f"{path}: [consume] names no Python handler (handler = {handler!r}): its messages are repaired by the "
            "registered SQL handler (omit --consume-config)",
            param_hint="--consume-config",
        )
    version = table.get("handler_version")
    return handler, str(version) if version is not None else None


def configured_handler(
    consume_config: Path | None, python_handler: str | None, handler_version: str | None
) -> tuple[str | None, str | None]:
    """--python and --handler-version as given, or else (with --consume-config) what the [consume]
    table names."""
    if consume_config is None:
        return python_handler, handler_version
    configured, configured_version = _consume_handler(consume_config)
    return python_handler or configured, handler_version or configured_version


def load_python_handler(spec: str) -> object:
    """The handler --python names (MODULE:FUNCTION); a usage error when it cannot be loaded."""
    try:
        return load_object(spec, "--python")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--python") from None
