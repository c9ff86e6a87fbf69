"""The version of the installed pginbox package, read once (pginbox.__version__)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["__version__"]


def _package_version() -> str:
    try:
        return version("pginbox")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


__version__: Final = _package_version()
