"""Every fenced code block of README.md and docs/**/*.md says whether a test runs it.

The HTML comment lines right above a block's opening fence carry its marker (README.md,
"Examples in the docs"):

    <!-- example: run by test_doc_sql.py -->             a test runs it (several: comma-separated)
    <!-- example: not run (output of the block above) -->  nothing can run it, and why
    <!-- example: todo (a psql session; no test compares it yet) -->  runnable, not run yet

`todo` is debt, kept visible: TODO_CEILING only goes down (lower it as blocks get their tests).

A test is named by its file name, found anywhere under tests/, so moving a test between tiers does
not break the markers; the file must exist and mention the page (its file name, e.g. `python.md`).
A block without a marker fails here with its page and line.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO_ROOT
from helpers_docs import blocks, pages

MARKER = re.compile(
    r"^\s*<!-- example: (?:run by (?P<tests>[\w./, -]+?)|not run \((?P<reason>.+)\)|todo \((?P<todo>.+)\)) -->\s*$"
)
TODO_CEILING = 0


def _test_files(root: Path) -> dict[str, list[Path]]:
    by_name: dict[str, list[Path]] = {}
    for path in (root / "tests").rglob("*.py"):
        by_name.setdefault(path.name, []).append(path)
    return by_name


def problems(root: Path = REPO_ROOT) -> tuple[list[str], dict[str, int]]:
    """What is wrong with the markers of every page, and how many blocks each status holds."""
    found: list[str] = []
    counts = {"run": 0, "not run": 0, "todo": 0}
    tests = _test_files(root)
    for path in pages(root):
        page_name = path.name
        for block in blocks(path, root):
            if block.marker is None:
                found.append(
                    f"{block.where}: a ```{block.lang} block without a marker: put "
                    "`<!-- example: run by test_x.py -->` or `<!-- example: not run (why) -->` "
                    "right above its fence"
                )
                continue
            match = MARKER.match(block.marker)
            if not match:
                found.append(f"{block.where}: malformed marker {block.marker!r}")
                continue
            if match.group("reason") is not None:
                counts["not run"] += 1
                continue
            if match.group("todo") is not None:
                counts["todo"] += 1
                continue
            counts["run"] += 1
            for name in (n.strip() for n in match.group("tests").split(",")):
                files = tests.get(Path(name).name, [])
                if len(files) != 1:
                    found.append(f"{block.where}: {name}: {'no' if not files else 'more than one'} such test file")
                elif page_name not in files[0].read_text():
                    found.append(f"{block.where}: {name} does not mention {page_name}")
    return found, counts


def test_every_doc_example_is_run_or_says_why_not() -> None:
    found, counts = problems()
    assert not found, "\n".join(found)
    assert counts["run"] > counts["not run"] > 0, counts
    assert counts["todo"] <= TODO_CEILING, f"more runnable blocks that no test runs: {counts}"


def test_an_unmarked_or_misattributed_block_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_page.py").write_text('PAGE = "docs/page.md"\n')
    (tmp_path / "tests" / "test_other.py").write_text("nothing\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\n<!-- example: not run (output) -->\n```\nout\n```\n"
        "<!-- example: run by test_page.py -->\n<!-- excerpt: a b -->\n```sql\nSELECT 1;\n```\n"
    )
    (tmp_path / "docs" / "page.md").write_text(
        "text\n\n```sql\nSELECT 1;\n```\n\n"
        "<!-- example: run by test_page.py, test_other.py -->\n  ~~~python\n  pass\n  ~~~\n"
        "<!-- example: run by test_gone.py -->\n````sh\n```\ninside\n```\n````\n"
        "<!-- example: skipped -->\n```sh\ntrue\n```\n"
        "<!-- example: todo (later) -->\n```sql\nSELECT 2;\n```\n"
    )
    readme = blocks(tmp_path / "README.md", tmp_path)
    assert [(b.line, b.lang, b.text) for b in readme] == [(4, "", "out\n"), (9, "sql", "SELECT 1;\n")]
    found, counts = problems(tmp_path)
    assert found == [
        "README.md:9: test_page.py does not mention README.md",
        "docs/page.md:3: a ```sql block without a marker: put `<!-- example: run by test_x.py -->` or "
        "`<!-- example: not run (why) -->` right above its fence",
        "docs/page.md:8: test_other.py does not mention page.md",
        "docs/page.md:12: test_gone.py: no such test file",
        "docs/page.md:18: malformed marker '<!-- example: skipped -->'",
    ]
    assert counts == {"run": 3, "not run": 1, "todo": 1}
