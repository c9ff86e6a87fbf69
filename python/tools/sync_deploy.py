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

Every deploy, revert and verify script not frozen yet pins its own search path: right after its
`BEGIN;` the line

    SET LOCAL search_path = pg_catalog, pg_temp;

(a script that does not run as one transaction, like message_key: `SET search_path = pg_catalog,
pg_temp;` as its first statement), and nothing after it changes the path again. Whatever runs the
script pins it too (psql-pinned, pginbox deploy, pginbox schema sql); the line keeps a script safe
when it is run some other way. --check refuses a script without it; a run without --check adds it
where it is missing (to the deploy script generated from a source that lacks it, and in place to
revert and verify scripts), and says so.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
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


def rendered(change: str, source: Path, *, pin: bool = False) -> str:
    """The deploy script generated from `source`; with pin, its search path pinned if the source
    does not pin it (a frozen script is compared with what it was generated as: no pin added)."""
    text = HEADER.format(change=change, source=source.name) + source.read_text()
    return with_pinned_search_path(text) if pin else text


# ----------------------------------------------------------------------------- the search path

PIN = "SET LOCAL search_path = pg_catalog, pg_temp;"
SESSION_PIN = "SET search_path = pg_catalog, pg_temp;"
PIN_ADVICE = (
    f"add the line `{PIN}` right after its `BEGIN;` (a script that does not run as one transaction: "
    f"`{SESSION_PIN}` as its first statement), or run python/tools/sync_deploy.py, which adds it. "
    "Unqualified names in a script resolve through the deployer's search_path otherwise, and anyone "
    "may have planted a function or operator in public (docs/releasing.md)"
)
_PIN_RE = re.compile(r"SET (?P<local>LOCAL )?(?:SESSION )?search_path ?(?:=|TO) ?pg_catalog ?, ?pg_temp", re.I)
_START_RE = re.compile(r"(?:BEGIN|START TRANSACTION)(?: (?:WORK|TRANSACTION|ISOLATION LEVEL .*|READ .*))?", re.I)
_END_RE = re.compile(r"(?:COMMIT|END|ROLLBACK|ABORT)(?: WORK| TRANSACTION)?(?: AND (?:NO )?CHAIN)?", re.I)
_CONTROL_RE = re.compile(
    r"(?:BEGIN|START TRANSACTION|COMMIT|END|ROLLBACK|ABORT|PREPARE TRANSACTION)\b(?! (?:WORK |TRANSACTION )?TO )", re.I
)
_PATH_CHANGE_RE = re.compile(
    r"(?:SET|RESET)\b.*\bsearch_path\b|RESET ALL\b|DISCARD ALL\b|(?!CREATE\b).*\bset_config ?\( ?'search_path'", re.I
)
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\x80-\uffff][A-Za-z0-9_\x80-\uffff]*)?\$")
_WORD = re.compile(r"[A-Za-z_\x80-\uffff][A-Za-z0-9_$\x80-\uffff]*")
_ROUTINE_STARTS = (
    ("CREATE", "FUNCTION"),
    ("CREATE", "PROCEDURE"),
    ("CREATE", "OR", "REPLACE", "FUNCTION"),
    ("CREATE", "OR", "REPLACE", "PROCEDURE"),
)


@dataclass(frozen=True)
class Statement:
    text: str  # without comments, whitespace collapsed to single blanks, quoted text kept
    start: int  # offset of its first character in the script
    end: int  # offset just after its semicolon (or the end of the script)


def _quote_end(script: str, i: int, escapes: bool) -> int:
    """Offset after the quoted text ('...' or "...") starting at i."""
    quote, j = script[i], i + 1
    while j < len(script):
        if escapes and script[j] == "\\":
            j += 2
        elif script[j] == quote:
            if not script.startswith(quote * 2, j):
                return j + 1
            j += 2
        else:
            j += 1
    return len(script)


def _comment_end(script: str, i: int) -> int:
    """Offset after the block comment starting at i (they nest)."""
    depth, j = 0, i
    while j < len(script):
        if script.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif script.startswith("*/", j):
            depth, j = depth - 1, j + 2
            if depth == 0:
                return j
        else:
            j += 1
    return len(script)


def _line_end(script: str, i: int) -> int:
    end = script.find("\n", i)
    return len(script) if end < 0 else end


def statements(script: str) -> list[Statement]:
    """The top-level SQL statements of a psql script, split where psql splits them: at a semicolon
    outside quotes, comments, dollar-quoted bodies and the BEGIN ... END of a SQL function's BEGIN
    ATOMIC body. psql's backslash commands end the statement before them and are skipped."""
    found: list[Statement] = []
    parts: list[str] = []
    words: list[str] = []
    start: int | None = None
    parens = atomic = 0

    def flush(end: int) -> None:
        nonlocal start, parens, atomic
        text = " ".join("".join(parts).split())
        if text and start is not None:
            found.append(Statement(text, start, end))
        parts.clear()
        words.clear()
        start, parens, atomic = None, 0, 0

    i, n = 0, len(script)
    while i < n:
        c = script[i]
        if script.startswith("--", i):
            parts.append(" ")
            i = _line_end(script, i)
            continue
        if script.startswith("/*", i):
            parts.append(" ")
            i = _comment_end(script, i)
            continue
        if c.isspace():
            parts.append(" ")
            i += 1
            continue
        if c == "\\":  # a psql meta-command, to the end of its line
            flush(i)
            i = _line_end(script, i)
            continue
        if c == ";" and atomic == 0:
            flush(i + 1)
            i += 1
            continue
        if start is None:
            start = i
        if c in "'\"":
            escapes = c == "'" and i > 0 and script[i - 1] in "eE" and (i < 2 or not _WORD.match(script[i - 2]))
            end = _quote_end(script, i, escapes)
        elif c == "$" and (tag := _DOLLAR_TAG.match(script, i)):
            close = script.find(tag.group(0), tag.end())
            end = n if close < 0 else close + len(tag.group(0))
        elif word := _WORD.match(script, i):
            end = word.end()
            upper = word.group(0).upper()
            if parens == 0 and any(tuple(words[: len(s)]) == s for s in _ROUTINE_STARTS):
                if upper == "BEGIN" or (upper == "CASE" and atomic):
                    atomic += 1
                elif upper == "END" and atomic:
                    atomic -= 1
            words.append(upper)
        else:
            parens += {"(": 1, ")": -1}.get(c, 0)
            end = i + 1
        parts.append(script[i:end])
        i = end
    flush(n)
    return found


def search_path_problem(script: str) -> str | None:
    """None when the script pins search_path = pg_catalog, pg_temp for everything it runs; else
    what is wrong, for a message."""
    found = statements(script)
    if not found:
        return None
    first = _PIN_RE.fullmatch(found[0].text)
    if first and not first.group("local"):
        rest = found[1:]
    elif _START_RE.fullmatch(found[0].text):
        if len(found) < 2 or not _PIN_RE.fullmatch(found[1].text):
            return f"its `{found[0].text};` is not followed by `{PIN}`"
        if not _END_RE.fullmatch(found[-1].text) or any(_CONTROL_RE.match(s.text) for s in found[2:-1]):
            return (
                "it pins the path with SET LOCAL but runs more than one transaction, and SET LOCAL ends with the first"
            )
        rest = found[2:]
    else:
        return f"it starts with `{found[0].text[:60]}`"
    for statement in rest:
        if _PATH_CHANGE_RE.match(statement.text) and not _PIN_RE.fullmatch(statement.text):
            return f"it changes the path again after pinning it: `{statement.text[:60]}`"
    return None


def pin_problem(name: str, why: str, fixable: bool) -> str:
    if fixable:
        return f"{name} does not pin its search_path ({why}): {PIN_ADVICE}"
    return f"{name} does not keep its search_path pinned ({why}): remove that (docs/releasing.md)"


def with_pinned_search_path(script: str) -> str:
    """The script with the pin added where it is missing: `SET LOCAL ...` after its BEGIN when it
    runs as one transaction, else `SET ...` before its first statement. Unchanged when it pins
    already, or when no added line can fix it (it changes the path again): --check says why."""
    found = statements(script)
    if not found or search_path_problem(script) is None:
        return script
    first = found[0]
    candidates = []
    if _START_RE.fullmatch(first.text):
        line_end = _line_end(script, first.end)
        if statements(script[first.end : line_end]) or line_end == len(script):
            candidates.append(f"{script[: first.end]}\n{PIN}\n{script[first.end :].lstrip(' ')}")
        else:
            candidates.append(f"{script[: line_end + 1]}{PIN}\n{script[line_end + 1 :]}")
    candidates.append(f"{script[: first.start]}{SESSION_PIN}\n{script[first.start :]}")
    return next((text for text in candidates if search_path_problem(text) is None), script)


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
            problems.append(
                f"{rel} was released and has been edited since: restore it from git; "
                "change a released change with sqitch rework (functions) or a new change (tables)"
            )
    generated = set()
    for change, source in found.items():
        if change not in changes:
            continue
        target = [c for c in plan.changes if c.name == change][-1].deploy_file
        generated.add(target)
        text = rendered(change, source, pin=target not in frozen)
        current = target.read_text() if target.exists() else None
        if target not in frozen and (why := search_path_problem(text)):
            problems.append(pin_problem(f"sql/{source.name}", why, fixable=False))
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
    problems += pin_unreleased(root, plan, frozen, generated, check)
    return problems


def pin_unreleased(root: Path, plan: Plan, frozen: dict[Path, str], generated: set[Path], check: bool) -> list[str]:
    """Every deploy, revert and verify script not frozen must pin its search path (the generated deploy
    scripts were handled with their sources). Without check, the pin is added where it can be."""
    problems = []
    unreleased = {script_path(root, change, kind) for change in plan.changes for kind in KINDS}
    for path in sorted(unreleased - set(frozen) - generated):
        if not path.exists():
            continue
        text = path.read_text()
        why = search_path_problem(text)
        if why is None:
            continue
        rel = path.relative_to(root)
        pinned = with_pinned_search_path(text)
        if check or pinned == text:
            problems.append(pin_problem(str(rel), why, fixable=pinned != text))
        else:
            path.write_text(pinned)
            print(f"pinned the search_path of {rel}")
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
