"""Which deployed schemas this package works with: one check for the library, the operator commands
and the demo (docs/releasing.md, "Compatibility between clients and databases").

A database says what it is with `inbox.schema_release()`: its API version (one per release), the
release name, and `breaking_since`, the version of the last release that broke clients of earlier
ones. This package knows the versions up to KNOWN_SCHEMA_VERSION and which of them broke earlier
clients (BREAKING_SCHEMA_VERSIONS). It refuses only what it cannot work with:

    database version known here                         -> run
    newer, its breaking_since known here                -> run, and warn once (a newer client exists)
    newer, breaking_since newer than anything known     -> refuse: upgrade the package
    older, and a version in between broke older clients -> refuse: deploy the schema

This check came with release 0.2.0 (schema version 2, not breaking: breaking_since 1). The 0.1.0
package accepts schema version 1 only: a 0.1.0 deployment upgrades this package before its database.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Final

from pginbox.errors import SchemaNewerWarning, SchemaVersionError

__all__ = [
    "BREAKING_SCHEMA_VERSIONS",
    "KNOWN_SCHEMA_RELEASE",
    "KNOWN_SCHEMA_VERSION",
    "SCHEMA_RELEASE",
    "SchemaRelease",
    "check_release",
    "version_text",
]

#: The schema version of this package's own release (0.3.0).
KNOWN_SCHEMA_VERSION: Final = 3
#: The name of that release, as inbox.schema_release() says it (sql/999_version.sql; a test keeps
#: the two, the package version and the CHANGELOG in step).
KNOWN_SCHEMA_RELEASE: Final = "0.3.0"
#: Versions whose release broke the clients of the versions before it (1: the first release;
#: 0.2.0 and 0.3.0 broke none).
BREAKING_SCHEMA_VERSIONS: Final = frozenset({1})
#: The one query every check runs.
SCHEMA_RELEASE: Final = "SELECT r.version, r.release, r.breaking_since FROM inbox.schema_release() r"

_DEPLOY = "deploy the schema this package ships: pginbox deploy --dsn <dsn> (or sqitch deploy in the pginbox project)"
# The package is not on PyPI (README, "Install and deploy"): a newer one comes from a newer checkout or wheel.
_UPGRADE = "upgrade the pginbox Python package (pip install -U ./python in a newer pginbox checkout, or its wheel)"


@dataclass(frozen=True)
class SchemaRelease:
    version: int
    release: str
    breaking_since: int


def version_text(package_version: str) -> str:
    """What `pginbox --version` prints: the package, the schema release it deploys, and the schema
    versions it works with."""
    supported = sorted(_supported())
    return (
        f"pginbox {package_version}\n"
        f"deploys schema release {KNOWN_SCHEMA_RELEASE} (schema version {KNOWN_SCHEMA_VERSION})\n"
        f"works with deployed schema versions {supported[0]} to {supported[-1]} "
        "(newer ones unless they break older clients)"
    )


def _supported() -> frozenset[int]:
    oldest = max(BREAKING_SCHEMA_VERSIONS)
    return frozenset(range(oldest, KNOWN_SCHEMA_VERSION + 1))


def check_release(row: object, where: str) -> SchemaRelease:
    """The release a row of SCHEMA_RELEASE describes, when this package can work with it; else
    SchemaVersionError saying what to do. A newer, compatible schema passes with a warning."""
    if not isinstance(row, tuple | list) or len(row) != 3 or not all(isinstance(v, int) for v in (row[0], row[2])):
        raise SchemaVersionError(
            f"schema inbox in {where} does not say which release it is: {_DEPLOY}", found=None, supported=_supported()
        )
    release = SchemaRelease(int(row[0]), str(row[1]), int(row[2]))
    if release.version > KNOWN_SCHEMA_VERSION:
        if release.breaking_since > KNOWN_SCHEMA_VERSION:
            raise SchemaVersionError(
                f"schema inbox in {where} is release {release.release} (version {release.version}), which breaks "
                f"clients of version {KNOWN_SCHEMA_VERSION} and older: {_UPGRADE}",
                found=release.version,
                supported=_supported(),
            )
        warnings.warn(
            f"schema inbox in {where} is release {release.release} (version {release.version}), newer than this "
            f"package knows (version {KNOWN_SCHEMA_VERSION}); it is compatible: {_UPGRADE} when you can",
            SchemaNewerWarning,
            stacklevel=3,
        )
        return release
    needed = [v for v in BREAKING_SCHEMA_VERSIONS if release.version < v <= KNOWN_SCHEMA_VERSION]
    if needed or release.version < 1:
        raise SchemaVersionError(
            f"schema inbox in {where} is release {release.release} (version {release.version}); this package "
            f"needs version {max(needed, default=1)} or later: {_DEPLOY}",
            found=release.version,
            supported=_supported(),
        )
    return release
