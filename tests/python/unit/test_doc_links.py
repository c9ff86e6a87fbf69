"""The documentation's relative links lead somewhere: python/tools/check_links.py over README,
CHANGELOG and docs/, and the checker itself catches what it is there to catch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "python" / "tools" / "check_links.py"


def run_tool(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, files)], capture_output=True, text=True, timeout=60, check=False
    )


def test_every_relative_link_and_anchor_of_the_docs_resolves() -> None:
    result = run_tool()
    assert result.returncode == 0, result.stdout
    assert result.stdout == ""
    assert ", 0 broken links" in result.stderr


def test_the_checker_reports_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## 6.16 `inbox.bind_consumer` — and more\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n"
        "[ok](other.md#616-inboxbind_consumer--and-more) [ok too](#page) [web](https://example.invalid/x.md)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading)\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    result = run_tool(page)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines == [
        f"{page}:3: missing.md: no such file",
        f"{page}:3: other.md#no-such-heading: no heading with that anchor in {tmp_path / 'other.md'}",
    ]


def test_explicit_html_anchors_count(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text('<a id="short-name"></a>\n\n## A long heading\n')
    page = tmp_path / "page.md"
    page.write_text("[x](other.md#short-name) [y](other.md#a-long-heading)\n")
    assert run_tool(page).returncode == 0
