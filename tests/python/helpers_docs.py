"""The fenced code blocks of the documentation (README.md and docs/**/*.md), with the example
marker each carries (test_doc_examples.py says what the markers mean)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO_ROOT

ANY_MARKER = re.compile(r"^\s*<!-- example:")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    marker: str | None  # the comment line, or None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path = REPO_ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path = REPO_ROOT) -> list[Block]:
    """Every fenced block of the page (CommonMark fences: ``` or ~~~, any indentation), with the
    example marker among the comment lines right above its opening fence."""
    relpath = str(path.relative_to(root))
    lines = path.read_text().split("\n")
    found: list[Block] = []
    opening: tuple[int, str, str, str | None] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if opening is None:
            if match and not (match.group("fence")[0] == "`" and "`" in match.group("info")):
                marker = None
                above = number - 2
                while above >= 0 and COMMENT.match(lines[above]):
                    if ANY_MARKER.match(lines[above]):
                        marker = lines[above].strip()
                        break
                    above -= 1
                opening = (number, match.group("fence"), match.group("info").strip(), marker)
                body = []
        elif match and match.group("fence").startswith(opening[1]) and not match.group("info").strip():
            found.append(Block(relpath, opening[0], opening[2], opening[3], "\n".join(body) + "\n"))
            opening = None
        else:
            body.append(line)
    assert opening is None, f"{relpath}:{opening[0]}: unclosed code fence"
    return found


def page_blocks(relpath: str, lang: str) -> list[str]:
    """The text of the page's blocks in that language, in order."""
    return [b.text for b in blocks(REPO_ROOT / relpath) if b.lang == lang]
