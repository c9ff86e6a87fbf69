#!/usr/bin/env python3
"""Writes deploy/<change>.sql from sql/NNN_<change>.sql: sql/ is the one place a developer edits.

    python/tools/sync_deploy.py           regenerate the deploy scripts of unreleased changes
    python/tools/sync_deploy.py --check   exit 1 if any deploy script differs from its source, or a
                                          released script changed (tests/run runs this)
    python/tools/sync_deploy.py --lock v0.2.0
                                          after `sqitch tag v0.2.0`: record in sqitch.lock the SHA-256
                                          of every script the tag releases (docs/releasing.md)

Each file sql/NNN_<change>.sql is the current state of the Sqitch change <change>. Its deploy script
is the same text under a header saying where it comes from. A change released at a tag (listed in
sqitch.lock) is frozen: its scripts are never rewritten, and editing its source is refused with what
to do instead (docs/releasing.md): `sqitch rework` for functions, a new change for tables.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_NAME = re.compile(r"^(\d{3})_([a-z][a-z0-9_]*)\.sql$")
HEADER = "-- Deploy pginbox:{change}. Generated from sql/{source} by python/tools/sync_deploy.py: edit that file.\n"
LOCK_FILE = "sqitch.lock"
KINDS = ("deploy", "revert", "verify")


@dataclass(frozen=True)
class Entry:
    """One line of sqitch.plan: a change or a tag, in plan order."""

    kind: str  # "change" | "tag"
    name: str


def read_plan(root: Path) -> list[Entry]:
    entries = []
    for raw in (root / "sqitch.plan").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("%", "#")):
            continue
        name = line.split()[0]
        entries.append(Entry("tag", name[1:]) if name.startswith("@") else Entry("change", name))
    return entries


def script_path(root: Path, entries: list[Entry], index: int, kind: str) -> Path:
    """The script of the change at entries[index], as Sqitch resolves it: a change that appears again
    later in the plan (reworked) keeps its scripts as <change>@<tag>.sql, the first tag after it
    whose file exists (else the first tag after it)."""
    name = entries[index].name
    later = [i for i in range(index + 1, len(entries)) if entries[i] == entries[index]]
    if not later:
        return root / kind / f"{name}.sql"
    tags = [e.name for e in entries[index + 1 : later[0]] if e.kind == "tag"]
    candidates = [root / kind / f"{name}@{tag}.sql" for tag in tags]
    return next((p for p in candidates if p.exists()), candidates[0] if candidates else root / kind / f"{name}.sql")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_lock(root: Path) -> list[tuple[str, str, str, str]]:
    """(tag, kind, change, sha256) of every script frozen at a release."""
    lock = root / LOCK_FILE
    if not lock.exists():
        return []
    rows = []
    for raw in lock.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            tag, kind, change, digest = raw.split()
            rows.append((tag, kind, change, digest))
    return rows


def frozen_scripts(root: Path, entries: list[Entry]) -> tuple[dict[Path, str], list[str]]:
    """{script path: sha256 recorded at its release}, and problems (a lock entry the plan cannot place)."""
    frozen: dict[Path, str] = {}
    problems = []
    for tag, kind, change, digest in read_lock(root):
        try:
            tag_index = entries.index(Entry("tag", tag))
        except ValueError:
            problems.append(f"{LOCK_FILE}: tag @{tag} is not in sqitch.plan")
            continue
        instances = [i for i in range(tag_index) if entries[i] == Entry("change", change)]
        if not instances:
            problems.append(f"{LOCK_FILE}: change {change} does not come before @{tag} in sqitch.plan")
            continue
        frozen[script_path(root, entries, instances[-1], kind)] = digest
    return frozen, problems


def sources(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((root / "sql").glob("*.sql")):
        match = SOURCE_NAME.match(path.name)
        if match is None:
            raise SystemExit(f"sql/{path.name}: a source is named NNN_<change>.sql")
        found[match.group(2)] = path
    return found


def rendered(change: str, source: Path) -> str:
    return HEADER.format(change=change, source=source.name) + source.read_text()


def sync(root: Path, check: bool) -> list[str]:
    """Writes (or with check, compares) every deploy script; returns the problems found."""
    entries = read_plan(root)
    changes = [e.name for e in entries if e.kind == "change"]
    found = sources(root)
    frozen, problems = frozen_scripts(root, entries)
    for change in sorted(set(changes) - set(found)):
        problems.append(f"sqitch.plan names change {change} but no sql/NNN_{change}.sql holds its source")
    for change in sorted(set(found) - set(changes)):
        problems.append(f"sql/{found[change].name} has no change {change} in sqitch.plan (sqitch add {change} ...)")
    for path, digest in sorted(frozen.items()):
        rel = path.relative_to(root)
        if not path.exists():
            problems.append(f"{rel} was released and is gone: restore it from git")
        elif sha256(path) != digest:
            problems.append(f"{rel} was released and has been edited since: restore it from git; "
                            "change a released change with sqitch rework (functions) or a new change (tables)")
    for change, source in found.items():
        if change not in changes:
            continue
        last = max(i for i, e in enumerate(entries) if e == Entry("change", change))
        target = script_path(root, entries, last, "deploy")
        text = rendered(change, source)
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        rel = target.relative_to(root)
        if target in frozen:
            problems.append(
                f"sql/{source.name} differs from {rel}, which was released and is frozen. "
                f"Functions, views, triggers: `sqitch rework {change} -n '...'`, then run this tool again. "
                "Tables, types, indexes: undo the edit and put the ALTER in a new change (docs/releasing.md)."
            )
        elif check:
            problems.append(f"{rel} is out of date with sql/{source.name}: run python/tools/sync_deploy.py")
        else:
            target.parent.mkdir(exist_ok=True)
            target.write_text(text)
            print(f"wrote {rel}")
    return problems


def lock(root: Path, tag: str) -> list[str]:
    """Appends to sqitch.lock the scripts of every change new or reworked since the previous tag."""
    entries = read_plan(root)
    try:
        tag_index = entries.index(Entry("tag", tag))
    except ValueError:
        return [f"tag @{tag} is not in sqitch.plan: run `sqitch tag {tag} -n '...'` first"]
    if any(row[0] == tag for row in read_lock(root)):
        return [f"{LOCK_FILE} already records @{tag}"]
    previous = max((i for i in range(tag_index) if entries[i].kind == "tag"), default=-1)
    released = [i for i in range(previous + 1, tag_index) if entries[i].kind == "change"]
    lines = [f"# @{tag}: the scripts it released. Never edit them (python/tools/sync_deploy.py --check)."]
    for index in released:
        for kind in KINDS:
            path = script_path(root, entries, index, kind)
            lines.append(f"{tag} {kind} {entries[index].name} {sha256(path)}")
    lock_path = root / LOCK_FILE
    existing = lock_path.read_text() if lock_path.exists() else ""
    lock_path.write_text(existing + "\n".join(lines) + "\n")
    print(f"recorded {len(released)} changes released at @{tag} in {LOCK_FILE}")
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on any difference")
    parser.add_argument("--lock", metavar="TAG", help="record the scripts released at TAG in sqitch.lock")
    parser.add_argument("--root", type=Path, default=ROOT, help="project directory (default: this checkout)")
    args = parser.parse_args()
    root = args.root.resolve()
    problems = sync(root, check=True) if args.lock else sync(root, args.check)
    if args.lock and not problems:
        problems = lock(root, args.lock)
    for problem in problems:
        print(f"sync_deploy: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
