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
from pathlib import Path

from pginbox.schema import sqitch_script
from pginbox.schema.sqitch_script import Plan, PlannedChange

ROOT = Path(__file__).resolve().parents[2]
SOURCE_NAME = re.compile(r"^(\d{3})_([a-z][a-z0-9_]*)\.sql$")
HEADER = "-- Deploy pginbox:{change}. Generated from sql/{source} by python/tools/sync_deploy.py: edit that file.\n"
LOCK_FILE = "sqitch.lock"
KINDS = ("deploy", "revert", "verify")


def read_plan(root: Path) -> Plan:
    try:
        return sqitch_script.read_plan(root)
    except sqitch_script.SqitchScriptError as exc:
        raise SystemExit(f"sync_deploy: {exc}") from None


def script_path(root: Path, change: PlannedChange, kind: str) -> Path:
    """The deploy, revert or verify script of one plan position, as Sqitch resolves it (a reworked
    change's earlier positions live in <change>@<tag>.sql)."""
    return root / kind / change.deploy_file.relative_to(root / "deploy")


def released_at(plan: Plan, tag: str, change: str) -> PlannedChange | None:
    """The position of `change` that tag @`tag` released: its last one at or before the tag."""
    tagged = plan.tag(tag).change.index
    before = [c for c in plan.changes if c.name == change and c.index <= tagged]
    return before[-1] if before else None


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


def frozen_scripts(root: Path, plan: Plan) -> tuple[dict[Path, str], list[str]]:
    """{script path: sha256 recorded at its release}, and problems (a lock entry the plan cannot place)."""
    frozen: dict[Path, str] = {}
    problems = []
    for tag, kind, change, digest in read_lock(root):
        try:
            position = released_at(plan, tag, change)
        except sqitch_script.SqitchScriptError:
            problems.append(f"{LOCK_FILE}: tag @{tag} is not in sqitch.plan")
            continue
        if position is None:
            problems.append(f"{LOCK_FILE}: change {change} does not come before @{tag} in sqitch.plan")
            continue
        frozen[script_path(root, position, kind)] = digest
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
    plan = read_plan(root)
    changes = [c.name for c in plan.changes]
    found = sources(root)
    frozen, problems = frozen_scripts(root, plan)
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
        target = [c for c in plan.changes if c.name == change][-1].deploy_file
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
    plan = read_plan(root)
    try:
        tagged = plan.tag(tag).change.index
    except sqitch_script.SqitchScriptError:
        return [f"tag @{tag} is not in sqitch.plan: run `sqitch tag {tag} -n '...'` first"]
    if any(row[0] == tag for row in read_lock(root)):
        return [f"{LOCK_FILE} already records @{tag}"]
    previous = max((c.index for c in plan.changes[:tagged] if c.tags), default=-1)
    released = [c for c in plan.changes if previous < c.index <= tagged]
    lines = [f"# @{tag}: the scripts it released. Never edit them (python/tools/sync_deploy.py --check)."]
    for change in released:
        for kind in KINDS:
            lines.append(f"{tag} {kind} {change.name} {sha256(script_path(root, change, kind))}")
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
