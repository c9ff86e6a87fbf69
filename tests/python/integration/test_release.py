"""One release story (issue 26): the package version, `pginbox --version`, the schema release the
Sqitch project deploys, the tags of sqitch.plan, the CHANGELOG and the release table of
docs/releasing.md agree; the docs install from a checkout or a wheel (the package is not on PyPI)
and the README names every extra."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import psycopg

from pginbox import __version__
from pginbox.schema.compat import BREAKING_SCHEMA_VERSIONS, KNOWN_SCHEMA_RELEASE, KNOWN_SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[3]


def _pginbox(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "pginbox"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, check=False)


def test_version_says_the_package_and_the_schema_release_it_deploys(conn: psycopg.Connection[Any]) -> None:
    pyproject = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    assert __version__ == pyproject["project"]["version"], "the installed package is this checkout's"
    assert __version__.startswith(KNOWN_SCHEMA_RELEASE), (
        f"package {__version__} is of release {KNOWN_SCHEMA_RELEASE} (a .devN until the release is cut)"
    )
    result = _pginbox("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"pginbox {__version__}",
        f"deploys schema release {KNOWN_SCHEMA_RELEASE} (schema version {KNOWN_SCHEMA_VERSION})",
        f"works with deployed schema versions {max(BREAKING_SCHEMA_VERSIONS)} to {KNOWN_SCHEMA_VERSION} "
        "(newer ones unless they break older clients)",
    ]
    # What the Sqitch project deploys (this test database) is the release --version names.
    deployed = conn.execute("SELECT version, release FROM inbox.schema_release()").fetchone()
    assert deployed == (KNOWN_SCHEMA_VERSION, KNOWN_SCHEMA_RELEASE)


def test_tags_changelog_and_release_table_agree() -> None:
    plan = (ROOT / "sqitch.plan").read_text()
    tags = re.findall(r"^@v(\d+\.\d+\.\d+) ", plan, re.MULTILINE)
    assert tags and tags == sorted(tags, key=lambda t: tuple(map(int, t.split("."))))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## (\d+\.\d+\.\d+) — (\S+)", changelog, re.MULTILINE)
    released = dict(sections)
    releasing = (ROOT / "docs" / "releasing.md").read_text()
    table = dict(re.findall(r"^\| (\d+\.\d+\.\d+) \| .*? \| `\((\d+), '\1', \d+\)` \|$", releasing, re.MULTILINE))
    for n, tag in enumerate(tags, start=1):
        assert tag in released and released[tag] != "unreleased", f"CHANGELOG has no dated section for v{tag}"
        assert table.get(tag) == str(n), f"docs/releasing.md's release table lacks {tag} (schema version {n})"
    # The release in the making: after the last tag, unreleased in the CHANGELOG, not in the table yet.
    assert len(tags) + 1 == KNOWN_SCHEMA_VERSION and KNOWN_SCHEMA_RELEASE not in tags
    assert released.get(KNOWN_SCHEMA_RELEASE) == "unreleased"
    assert re.search(rf"^version \[version@v{re.escape(tags[-1])} ", plan, re.MULTILINE), (
        "the version change of the release in the making is reworked after the last tag"
    )


def test_install_instructions_use_a_checkout_or_a_wheel_and_name_every_extra() -> None:
    pyproject = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    extras = sorted(pyproject["project"]["optional-dependencies"])
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install and deploy") :]
    install = install[: install.index("\n## ", 4)]
    for extra in extras:
        assert f"`{extra}`" in install, f"README's install section does not name the extra {extra!r}"
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in documents:
        text = path.read_text()
        # `pip install pginbox` / 'pginbox[x]' would fetch from a registry, where it is not.
        found = re.findall(r"pip install (?:-U )?['\"]?pginbox\b", text)
        assert not found, f"{path.name}: {found} (the package is not on PyPI: ./python or a wheel)"
