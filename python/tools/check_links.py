"""Check the relative links of the Markdown documentation: every target file exists, and every
#anchor names a heading of its file (GitHub's slugs: lower case, punctuation dropped, spaces to
hyphens, -1, -2 ... for repeats) or an explicit `<a id="...">`. Links inside fenced code blocks
and absolute URLs are skipped.

    .venv/bin/python python/tools/check_links.py [FILE.md ...]   # default: README, CHANGELOG, docs/

Prints one line per broken link (file:line: target: why) and exits 1 when there is any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _lines_outside_fences(text: str) -> Iterator[tuple[int, str]]:
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading text (inline code and links reduced to their text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result: set[str] = set()
    for _, line in _lines_outside_fences(path.read_text(encoding="utf-8")):
        result.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> Iterator[str]:
    cache: dict[Path, set[str]] = {}
    for number, line in _lines_outside_fences(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            where = f"{_shown(path)}:{number}: {target}"
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                yield f"{where}: no such file"
                continue
            if not anchor:
                continue
            if linked.suffix != ".md" or linked.is_dir():
                yield f"{where}: an anchor into a file that is not Markdown"
                continue
            if linked not in cache:
                cache[linked] = anchors(linked)
            if anchor not in cache[linked]:
                yield f"{where}: no heading with that anchor in {_shown(linked)}"


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]
    problems = [problem for f in files for problem in broken_links(f)]
    for problem in problems:
        print(problem)
    print(f"{len(files)} files, {len(problems)} broken links", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
