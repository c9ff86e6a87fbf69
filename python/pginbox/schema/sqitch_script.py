"""The Sqitch project rendered as one plain SQL script for psql, for hosts without Sqitch.

`render_script(project_dir, to=..., since=...)` returns a psql script that deploys the plan's
changes in order, each with its own deploy script included verbatim, and after each change writes
the rows `sqitch deploy` would have written to Sqitch's registry (schema `sqitch`, registry v1.1 as
Sqitch 1.3.1 creates it). Sqitch can take over such a database: status, verify, revert, deploy.

Everything that must match Sqitch byte for byte follows App::Sqitch 1.3.1 (/usr/share/perl5/App/Sqitch):
  - plan syntax and rework tags:       Plan.pm (_parse), Plan/Depend.pm (parse, as_string)
  - change and tag ids:                Plan/Change.pm and Plan/Tag.pm (info, id): SHA-1 over
                                       "change <len>\\0<info>" resp. "tag <len>\\0<info>"
  - which file a reworked change uses: Plan/Change.pm (path_segments, deploy_dir)
  - script_hash:                       Plan/Change.pm (_deploy_hash): SHA-1 of the file's bytes
  - the registry rows:                 Role/DBIEngine.pm (register_project, log_deploy_change,
                                       _log_event, log_new_tags), Engine.pm (check_deploy_dependencies)
  - the registry DDL:                  Engine/pg.sql, copied as sqitch_registry_pg.sql

The script sets search_path = pg_catalog, pg_temp before anything else and again after each
change's RESET ALL, so every deploy script runs pinned whatever the deployer's search_path says:
a function or operator planted in a writable public schema cannot shadow a built-in it calls.

Committer fields (and the installer/creator fields of the release and project rows) are
`committer_name` / `committer_email` when given; by default they are computed by the database while
the script runs: the session user, and `session_user@<server address or localhost>` (Sqitch's own
fallback is the operating-system user at the host name).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path

from psycopg import sql

from pginbox.errors import SqitchScriptError

__all__ = [
    "REGISTRY_RELEASE",
    "REGISTRY_SCHEMA",
    "Dependency",
    "Plan",
    "PlannedChange",
    "PlannedTag",
    "SqitchScriptError",
    "canonical_uri",
    "read_plan",
    "render_script",
]

REGISTRY_SCHEMA = "sqitch"
REGISTRY_RELEASE = "1.1"  # App::Sqitch::Engine::registry_release in Sqitch 1.3.1
REGISTRY_DDL_RESOURCE = "sqitch_registry_pg.sql"  # App/Sqitch/Engine/pg.sql of Sqitch 1.3.1
ADVISORY_LOCK_KEY = 75474063  # App::Sqitch::Engine::pg::try_lock / wait_lock
LOCK_WAIT = "60s"  # Sqitch's default --lock-timeout
# What every deploy script (and the registry statements around it) runs with: the released scripts
# call built-ins unqualified and are frozen, so the script pins the path for them (docs/security.md).
SET_SEARCH_PATH = "SET search_path = pg_catalog, pg_temp;"


# --------------------------------------------------------------------------- plan model


@dataclass(frozen=True)
class Dependency:
    """One entry of a change's `[...]` list (App::Sqitch::Plan::Depend)."""

    conflicts: bool
    project: str | None  # None: an id not found in this plan (external, project unknown)
    change: str | None
    tag: str | None
    change_id: str | None  # a 40-hex id written in the plan, else None
    local_project: str

    @property
    def key_name(self) -> str:
        parts = ""
        if self.change is not None:
            parts += self.change
        if self.tag is not None:
            parts += "@" + self.tag
        if not parts and self.change_id is not None:
            parts = self.change_id
        return parts

    @property
    def is_local(self) -> bool:
        return self.project == self.local_project

    def as_string(self) -> str:
        """What the registry stores (dependencies.dependency, events.requires/conflicts)."""
        if self.project is None or self.is_local:
            return self.key_name
        return f"{self.project}:{self.key_name}"


@dataclass
class PlannedTag:
    name: str  # without the @
    timestamp: str  # 2024-01-02T03:04:05Z, as Sqitch formats it (always UTC)
    planner_name: str
    planner_email: str
    note: str
    change: PlannedChange
    id: str = ""

    @property
    def format_name(self) -> str:
        return "@" + self.name


@dataclass
class PlannedChange:
    name: str
    index: int
    timestamp: str
    planner_name: str
    planner_email: str
    note: str
    requires: list[Dependency]
    conflicts: list[Dependency]
    line_number: int
    tags: list[PlannedTag] = field(default_factory=list)
    # Tags naming the file of an earlier instance of a reworked change, in Sqitch's order.
    rework_tags: list[PlannedTag] = field(default_factory=list)
    id: str = ""
    deploy_file: Path = Path()

    @property
    def dependencies(self) -> list[Dependency]:
        return [*self.requires, *self.conflicts]


@dataclass
class Plan:
    file: Path
    project: str
    uri: str | None
    changes: list[PlannedChange]
    raw_sha1: str  # of the plan file, for the script header
    _lookup: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def tag(self, name: str) -> PlannedTag:
        """The tag `name` (with or without its @)."""
        wanted = name[1:] if name.startswith("@") else name
        for change in self.changes:
            for tag in change.tags:
                if tag.name == wanted:
                    return tag
        known = ", ".join(t.format_name for c in self.changes for t in c.tags) or "none"
        raise SqitchScriptError(f'unknown tag "{name}" in {self.file} (tags in the plan: {known})')

    def find(self, key: str) -> int | None:
        """Index of the change `key` names, as App::Sqitch::Plan::ChangeList::find."""
        if "@" not in key:
            found = self._lookup.get(key)
            return found[0] if found else None
        change, tag = key.split("@", 1)
        if change == "":
            found = self._lookup.get("@" + tag)
            return found[0] if found else None
        indexes = self._lookup.get(change)
        if not indexes:
            return None
        tag_at = self._lookup.get("@" + tag)
        if tag_at is None:
            raise SqitchScriptError(f'unknown tag "@{tag}" in dependency "{key}" ({self.file})')
        before = [i for i in indexes if i <= tag_at[0]]
        return before[-1] if before else None


# --------------------------------------------------------------------------- plan parsing

# Like [:punct:] without "_" (Plan.pm's $punct).
_PUNCT = r"""\-!"#$%&'()*+,./:;<=>?@\[\\\]^`{|}~"""
_NAME = (
    rf"(?![{_PUNCT}])"
    r"(?:(?![~/=%^][0-9]+(?:$|[ \t]))[^ \t:@#\\])+"
    rf"(?<![{_PUNCT}])\b"
)
_NAME_RE = re.compile(rf"\A{_NAME}\Z")
_TIMESTAMP = r"(?P<yr>[0-9]{4})-(?P<mo>[0-9]{2})-(?P<dy>[0-9]{2})T(?P<hr>[0-9]{2}):(?P<mi>[0-9]{2}):(?P<sc>[0-9]{2})Z"
_TIMESTAMP_RE = re.compile(_TIMESTAMP)
_PLANNER = r"(?P<planner_name>[^<]+)[ \t]+<(?P<planner_email>[^>]+)>"
_BLANK_RE = re.compile(r"\A[ \t]*(?:#[ \t]*(?P<note>.+)|$)")
_NOTE_RE = re.compile(r"[ \t]*(?:#[ \t]*(?P<note>.*))?$")
_PRAGMA_RE = re.compile(
    rf"\A[ \t]*%[ \t]*(?P<name>[^{_PUNCT}](?:[^ \t=]*?[^{_PUNCT} \t])?)"
    r"(?:[ \t]*=[ \t]*(?P<value>.+))?\Z"
)
_LINE_RE = re.compile(
    r"^[ \t]*(?:@|[ \t]*(?P<operator>[+-])[ \t]*)?"
    rf"(?P<name>{_NAME})[ \t]*"
    r"(?:\[(?P<dependencies>[^\]]+)\][ \t]*)?"
    rf"(?:{_TIMESTAMP}[ \t]*)?"
    rf"(?:{_PLANNER})?$"
)
_DEPENDENCY_RE = re.compile(
    rf"\A(?P<conflicts>!?)(?:(?P<project>{_NAME}):)?"
    rf"(?:(?P<id>[0-9a-f]{{40}})|(?P<change>{_NAME})(?:@(?P<tag>{_NAME}))?|(?:@(?P<tag_only>{_NAME}))?)\Z"
)
_SHA1_LIKE = re.compile(r"^[0-9a-f]{40}")
_RESERVED = frozenset({"ROOT", "HEAD"})
_NOTE_UNESCAPE = {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}


def _perl_true(value: str) -> bool:
    """Sqitch tests notes for truth the Perl way: "" and "0" are false."""
    return value not in ("", "0")


def _plan_note(raw: str | None) -> str:
    """App::Sqitch::Plan::Line::BUILDARGS: trim, then decode \\\\, \\n and \\r."""
    if raw is None or not _perl_true(raw):
        return raw or ""
    note = re.sub(r"\A\s+|\s+\Z", "", raw)
    return re.sub(r"\\[\\nr]", lambda m: _NOTE_UNESCAPE[m.group(0)], note)


@dataclass
class _Layout:
    plan_file: Path
    deploy_dir: Path
    reworked_deploy_dir: Path
    extension: str


def _read_config(project_dir: Path) -> dict[str, str]:
    """The keys of the project's sqitch.conf (git-config syntax) as "section[.sub].key": value."""
    path = project_dir / "sqitch.conf"
    if not path.is_file():
        return {}
    values: dict[str, str] = {}
    section = ""
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        header = re.fullmatch(r'\[\s*([A-Za-z0-9.-]+)(?:\s+"((?:[^"\\]|\\.)*)")?\s*\]', line)
        if header:
            section = header.group(1).lower()
            if header.group(2) is not None:
                section += "." + re.sub(r"\\(.)", r"\1", header.group(2))
            continue
        entry = re.fullmatch(r"([A-Za-z][A-Za-z0-9_-]*)\s*(?:=\s*(.*))?", line)
        if entry is None or not section:
            raise SqitchScriptError(f"cannot read {path} line {number}: {raw!r}")
        value = entry.group(2) or ""
        value = re.split(r'\s[#;](?=(?:[^"]*"[^"]*")*[^"]*$)', value, maxsplit=1)[0].strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        values[f"{section}.{entry.group(1).lower()}"] = value
    return values


def _layout(project_dir: Path) -> _Layout:
    """Where the plan and the deploy scripts are, as App::Sqitch::Target resolves them from the
    project's sqitch.conf (target, then engine, then core settings; user and system configuration
    files are not read)."""
    config = _read_config(project_dir)
    engine = config.get("core.engine", "pg")
    if engine != "pg":
        raise SqitchScriptError(f"sqitch.conf sets core.engine = {engine}: only the pg engine can be rendered")
    target = config.get("engine.pg.target") or config.get("core.target")
    scopes = [f"target.{target}"] if target else []
    scopes += ["engine.pg", "core"]

    def setting(key: str) -> str | None:
        for scope in scopes:
            if f"{scope}.{key}" in config:
                return config[f"{scope}.{key}"]
        return None

    registry = setting("registry")
    if registry not in (None, REGISTRY_SCHEMA):
        raise SqitchScriptError(
            f"sqitch.conf sets registry = {registry}: the rendered script only writes the default "
            f"registry schema {REGISTRY_SCHEMA}"
        )
    if any(".variables." in key or key.startswith("variables.") for key in config):
        raise SqitchScriptError(
            "sqitch.conf defines script variables: the rendered script cannot pass them to psql; "
            "remove them or deploy with sqitch"
        )

    def directory(key: str, default: Path) -> Path:
        value = setting(key)
        return project_dir / value if value else default

    top_dir = directory("top_dir", project_dir)
    reworked_dir = directory("reworked_dir", top_dir)
    return _Layout(
        plan_file=directory("plan_file", top_dir / "sqitch.plan"),
        deploy_dir=directory("deploy_dir", top_dir / "deploy"),
        reworked_deploy_dir=directory("reworked_deploy_dir", reworked_dir / "deploy"),
        extension=setting("extension") or "sql",
    )


def _timestamp(match: re.Match[str]) -> str:
    year, month, day, hour, minute, second = (int(match.group(n)) for n in ("yr", "mo", "dy", "hr", "mi", "sc"))
    try:
        datetime(year, month, day, hour, minute, second)  # validation only: the plan's times are UTC
    except ValueError as exc:
        raise ValueError(f"invalid timestamp: {exc}") from None
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}Z"


def _parse_dependencies(
    text: str, project: str, syntax_error: _SyntaxError
) -> tuple[list[Dependency], list[Dependency]]:
    requires: list[Dependency] = []
    conflicts: list[Dependency] = []
    seen: set[str] = set()
    for spec in re.split(r"[ \t]+", text.strip()):
        match = _DEPENDENCY_RE.match(spec)
        if match is None or not (match.group("id") or match.group("change") or match.group("tag_only")):
            raise syntax_error(f'"{spec}" is not a valid dependency specification')
        if spec in seen:
            raise syntax_error(f'Duplicate dependency "{spec}"')
        seen.add(spec)
        dependency = Dependency(
            conflicts=bool(match.group("conflicts")),
            # An id with no project is resolved against the plan later (see _index_and_identify).
            project=match.group("project") or (None if match.group("id") else project),
            change=match.group("change"),
            tag=match.group("tag") or match.group("tag_only"),
            change_id=match.group("id"),
            local_project=project,
        )
        (conflicts if dependency.conflicts else requires).append(dependency)
    return requires, conflicts


class _SyntaxError:
    """Builds Sqitch's 'Syntax error in FILE at line N: ...' errors for the line being read."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.line_number = 0

    def __call__(self, message: str) -> SqitchScriptError:
        return SqitchScriptError(f"syntax error in {self.file} at line {self.line_number}: {message}")


def _parse_plan(file: Path) -> Plan:
    """Plan::_parse, minus what Sqitch keeps only to write the plan back out."""
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise SqitchScriptError(f"cannot read the plan {file}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SqitchScriptError(f"{file} is not valid UTF-8 (byte {exc.start}): Sqitch reads plans as UTF-8") from None

    lines = text.split("\n")
    syntax_error = _SyntaxError(file)
    pragmas: dict[str, str | None] = {}
    position = 0
    while position < len(lines):
        line = lines[position].removesuffix("\r")
        position += 1
        syntax_error.line_number = position
        blank = _BLANK_RE.match(line)
        if blank:
            if not _plan_note(blank.group("note")):
                break  # a blank line ends the pragmas
            continue
        inline = _NOTE_RE.search(line)
        line = line[: inline.start()] if inline else line
        pragma = _PRAGMA_RE.match(line)
        if pragma is None:
            raise syntax_error("Invalid pragma; a blank line must come between pragmas and changes")
        name, value = pragma.group("name"), pragma.group("value")
        if name == "project" and (value is None or not _NAME_RE.match(value)):
            raise syntax_error(
                f'invalid project name "{value or ""}": project names must not begin with punctuation, '
                'contain "@", ":", "#", "\\", or blanks, or end in punctuation or digits following punctuation'
            )
        pragmas[name] = value
    project = pragmas.get("project")
    if not project:
        raise SqitchScriptError(f"Missing %project pragma in {file}")

    changes: list[PlannedChange] = []
    change_named: dict[str, PlannedChange] = {}
    since_tag: dict[str, int] = {}  # change name -> line, for the changes since the last tag
    tag_lines: dict[str, int] = {}
    while position < len(lines):
        line = lines[position].removesuffix("\r")
        position += 1
        syntax_error.line_number = position
        if _BLANK_RE.match(line):
            continue
        note_match = _NOTE_RE.search(line)
        raw_note = note_match.group("note") if note_match else None
        line = line[: note_match.start()] if note_match else line
        is_tag = re.match(r"^[ \t]*@", line) is not None
        match = _LINE_RE.match(line)
        if match is None or (match.group("yr") is None and _TIMESTAMP_RE.search(line)):
            raise syntax_error(
                'Invalid name; names must not begin with punctuation, contain "@", ":", "#", "\\", '
                "or blanks, or end in punctuation or digits following punctuation"
            )
        if match.group("yr") is None and match.group("planner_name") is None:
            raise syntax_error("Missing timestamp and planner name and email")
        if match.group("yr") is None:
            raise syntax_error("Missing timestamp")
        if match.group("planner_name") is None:
            raise syntax_error("Missing planner name and email")
        name = match.group("name")
        if name in _RESERVED:
            raise syntax_error(f'"{"@" if is_tag else ""}{name}" is a reserved name')
        if _SHA1_LIKE.match(name):
            raise syntax_error(f'"{name}" is invalid because it could be confused with a SHA1 ID')
        try:
            timestamp = _timestamp(match)
        except ValueError as exc:
            raise syntax_error(str(exc)) from None
        note = _plan_note(raw_note)
        planner_name, planner_email = match.group("planner_name"), match.group("planner_email")

        if is_tag:
            if "/" in name:
                raise syntax_error(f'Tag "{name}" contains illegal character /')
            if not changes:
                raise syntax_error(f'Tag "{name}" declared without a preceding change')
            if "@" + name in tag_lines:
                raise syntax_error(f'Tag "{name}" duplicates earlier declaration on line {tag_lines["@" + name]}')
            if match.group("dependencies"):
                raise syntax_error("Tags may not specify dependencies")
            changes[-1].tags.append(PlannedTag(name, timestamp, planner_name, planner_email, note, change=changes[-1]))
            tag_lines["@" + name] = position
            since_tag.clear()
            continue

        if match.group("operator") == "-":
            raise syntax_error(f'"-{name}": changes marked for revert ("-") are not supported; remove the line')
        if name in since_tag:
            raise syntax_error(f'Change "{name}" duplicates earlier declaration on line {since_tag[name]}')
        requires: list[Dependency] = []
        conflicts: list[Dependency] = []
        if match.group("dependencies"):
            requires, conflicts = _parse_dependencies(match.group("dependencies"), project, syntax_error)
        change = PlannedChange(
            name=name,
            index=len(changes),
            timestamp=timestamp,
            planner_name=planner_name,
            planner_email=planner_email,
            note=note,
            requires=requires,
            conflicts=conflicts,
            line_number=position,
        )
        duped = change_named.get(name)
        if duped is not None:
            # Plan::_parse: the tags of every change after the earlier instance, latest first,
            # then the earlier instance's own tags.
            for earlier in reversed(changes[duped.index + 1 :]):
                duped.rework_tags.extend(earlier.tags)
            duped.rework_tags.extend(duped.tags)
        change_named[name] = change
        since_tag[name] = position
        changes.append(change)

    plan = Plan(
        file=file,
        project=project,
        uri=pragmas.get("uri"),
        changes=changes,
        raw_sha1=hashlib.sha1(raw).hexdigest(),
    )
    _index_and_identify(plan)
    return plan


def _sha1_id(kind: str, info: str) -> str:
    content = info.encode("utf-8")
    return hashlib.sha1(f"{kind} {len(content)}\0".encode() + content).hexdigest()


def _change_info(plan: Plan, change: PlannedChange, canonical: str | None) -> str:
    """App::Sqitch::Plan::Change::info."""
    lines = [f"project {plan.project}"]
    if canonical is not None:
        lines.append(f"uri {canonical}")
    lines.append(f"change {change.name}")
    if change.index > 0:
        lines.append(f"parent {plan.changes[change.index - 1].id}")
    lines.append(f"planner {change.planner_name} <{change.planner_email}>")
    lines.append(f"date {change.timestamp}")
    if change.requires:
        lines.append("requires\n  + " + "\n  + ".join(d.as_string() for d in change.requires))
    if change.conflicts:
        lines.append("conflicts\n  - " + "\n  - ".join(d.as_string() for d in change.conflicts))
    if _perl_true(change.note):
        lines += ["", change.note]
    return "\n".join(lines)


def _tag_info(plan: Plan, tag: PlannedTag, canonical: str | None) -> str:
    """App::Sqitch::Plan::Tag::info."""
    lines = [f"project {plan.project}"]
    if canonical is not None:
        lines.append(f"uri {canonical}")
    lines += [
        f"tag {tag.format_name}",
        f"change {tag.change.id}",
        f"planner {tag.planner_name} <{tag.planner_email}>",
        f"date {tag.timestamp}",
    ]
    if _perl_true(tag.note):
        lines += ["", tag.note]
    return "\n".join(lines)


def _index_and_identify(plan: Plan) -> None:
    canonical = canonical_uri(plan.uri) if plan.uri else None
    for change in plan.changes:
        change.id = _sha1_id("change", _change_info(plan, change, canonical))
        for tag in change.tags:
            tag.id = _sha1_id("tag", _tag_info(plan, tag, canonical))
    lookup = plan._lookup
    for change in plan.changes:
        lookup.setdefault(change.name, []).append(change.index)
        lookup[change.id] = [change.index]
        for tag in change.tags:
            lookup[tag.format_name] = [change.index]
            lookup[tag.id] = [change.index]
    if plan.changes:
        lookup["HEAD"] = lookup["@HEAD"] = [len(plan.changes) - 1]
        lookup["ROOT"] = lookup["@ROOT"] = [0]
    # Depend::project: an id with no project is this project's when the plan knows it.
    for change in plan.changes:
        for kind in ("requires", "conflicts"):
            deps: list[Dependency] = getattr(change, kind)
            for i, dep in enumerate(deps):
                if dep.change_id is not None and dep.project is None and dep.change_id in lookup:
                    deps[i] = Dependency(
                        dep.conflicts, plan.project, dep.change, dep.tag, dep.change_id, dep.local_project
                    )


def _check_local_dependencies(plan: Plan) -> None:
    """Plan::check_changes and Depend::id: a change may only require (or name as a conflict)
    changes of this project that are planned before it, resp. that exist in the plan."""
    for change in plan.changes:
        for dep in change.dependencies:
            if not dep.is_local:
                continue
            target = plan.find(dep.key_name)
            verb = "conflicts with" if dep.conflicts else "requires"
            if target is None:
                raise SqitchScriptError(f'change "{change.name}" {verb} "{dep.key_name}", which is not in {plan.file}')
            if not dep.conflicts and target >= change.index:
                raise SqitchScriptError(
                    f'change "{change.name}" requires "{dep.key_name}", which is not planned before it '
                    f"in {plan.file}: move the change below it"
                )


def _assign_deploy_files(plan: Plan, layout: _Layout) -> None:
    """App::Sqitch::Plan::Change::deploy_file / path_segments."""
    extension = "." + layout.extension
    for change in plan.changes:
        segments = change.name.split("/")
        if change.rework_tags:
            directory = layout.reworked_deploy_dir.joinpath(*segments[:-1])
            candidates = [f"{segments[-1]}{tag.format_name}{extension}" for tag in change.rework_tags]
            existing = [name for name in candidates if (directory / name).exists()]
            change.deploy_file = directory / (existing[0] if existing else candidates[0])
        else:
            change.deploy_file = layout.deploy_dir.joinpath(*segments[:-1], segments[-1] + extension)


def read_plan(project_dir: Path) -> Plan:
    """The project's plan with every change's id, tag ids, dependencies and deploy script path.

    Raises SqitchScriptError when the plan cannot be read or parsed.
    """
    layout = _layout(project_dir)
    plan = _parse_plan(layout.plan_file)
    _check_local_dependencies(plan)
    _assign_deploy_files(plan, layout)
    return plan


# --------------------------------------------------------------------------- URI


# Schemes Perl's URI 5.x canonicalizes with rules of their own (URI/<scheme>.pm); http and https
# are implemented below, the others are refused rather than guessed.
_URI_SPECIAL_SCHEME_NAMES = (
    "cassandra cockroach cockroachdb couch couchdb cubrid data db db2 derby exasol file firebird ftp "
    "gopher hive impala informix ingres interbase ldap ldapdb ldapi ldaps mailto maria mariadb max "
    "maxdb mms monet monetdb mongo mongodb mssql mysql news nntp nntps oracle pg pgsql pgxc pop "
    "postgres postgresql postgresxc redshift rlogin rsync rtsp rtspu sftp sip sips snews snowflake "
    "sqlite sqlite3 sqlserver ssh sybase telnet teradata tn3270 unify urn vertica yugabyte yugabytedb"
)
_URI_SPECIAL_SCHEMES = frozenset(_URI_SPECIAL_SCHEME_NAMES.split())
_URI_UNRESERVED = re.compile(r"[A-Za-z0-9\-_.!~*'()]")
_URI_ALLOWED = re.compile(r"[A-Za-z0-9\-_.!~*'();/?:@&=+$,\[\]%#]*")
_URI_DEFAULT_PORTS = {"http": 80, "https": 443}


def canonical_uri(uri: str) -> str:
    """Perl URI's `URI->new($uri)->canonical`, which Sqitch puts in change and tag ids, for
    http and https URIs and schemes URI treats generically. Raises SqitchScriptError otherwise."""
    if not _URI_ALLOWED.fullmatch(uri):
        raise SqitchScriptError(f"%uri={uri}: characters that need percent-encoding; encode them in the plan")
    scheme_match = re.match(r"([A-Za-z][A-Za-z0-9.+\-]*):", uri)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme in _URI_SPECIAL_SCHEMES:
        raise SqitchScriptError(
            f"%uri={uri}: the {scheme}: scheme is not supported (change ids depend on how Perl's URI "
            "module canonicalizes it); use an http(s) URI"
        )
    rest = uri[len(scheme_match.group(0)) :] if scheme_match else uri

    def unescape(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if _URI_UNRESERVED.fullmatch(char) else "%" + match.group(1).upper()

    rest = re.sub(r"%([0-9a-fA-F]{2})", unescape, rest)
    if scheme in _URI_DEFAULT_PORTS:
        parts = re.fullmatch(r"//([^/?#]*)([^?#]*)(\?[^#]*)?(#.*)?", rest)
        if parts is not None:
            authority, path, query, fragment = parts.groups()
            userinfo, at, hostport = authority.rpartition("@")
            host_match = re.fullmatch(r"(\[[^\]]*\]|[^:]*)(?::([0-9]*))?", hostport)
            if host_match is not None:
                host, port = host_match.groups()
                hostport = host.lower()
                if port is not None and port != "" and int(port) != _URI_DEFAULT_PORTS[scheme]:
                    hostport += ":" + port
            authority = userinfo + at + hostport
            if path == "" and query is None:
                path = "/"
            rest = "//" + authority + path + (query or "") + (fragment or "")
    return (scheme + ":" if scheme_match else "") + rest


# --------------------------------------------------------------------------- rendering


def _registry_ddl() -> str:
    return resources.files("pginbox.schema").joinpath(REGISTRY_DDL_RESOURCE).read_text(encoding="utf-8")


def _table(name: str) -> sql.Composable:
    return sql.Identifier(REGISTRY_SCHEMA, name)


def _render(statement: sql.Composable) -> str:
    return statement.as_string(None)


@dataclass(frozen=True)
class _Committer:
    name: sql.Composable
    email: sql.Composable


def _committer(name: str | None, email: str | None) -> _Committer:
    return _Committer(
        name=sql.Literal(name) if name is not None else sql.SQL("session_user"),
        email=(
            sql.Literal(email)
            if email is not None
            else sql.SQL("session_user || '@' || coalesce(pg_catalog.host(pg_catalog.inet_server_addr()), 'localhost')")
        ),
    )


def _change_id_for(dep: Dependency, resolved: dict[str, str]) -> sql.Composable:
    """SQL for the change id a dependency resolves to in the registry, NULL when it does not
    (Engine::change_id_for_depend and DBIEngine::change_id_for with first => 1)."""
    changes, tags = _table("changes"), _table("tags")
    if dep.is_local or dep.change_id is not None:
        wanted = resolved[dep.key_name] if dep.is_local else dep.change_id
        return sql.SQL("(SELECT change_id FROM {} WHERE change_id = {})").format(changes, sql.Literal(wanted))
    project = sql.Literal(dep.project)
    if dep.change is not None:
        change = sql.Literal(dep.change)
        if dep.tag == "ROOT":
            return sql.SQL("NULL::text")
        if dep.tag == "HEAD":
            return sql.SQL(
                "(SELECT change_id FROM {} WHERE project = {} AND change = {} ORDER BY committed_at DESC LIMIT 1)"
            ).format(changes, project, change)
        if dep.tag is not None:
            return sql.SQL(
                "(SELECT c.change_id FROM {} c JOIN {} t ON c.committed_at <= t.committed_at AND c.project = t.project"
                " WHERE c.project = {} AND c.change = {} AND t.tag = {} ORDER BY c.committed_at DESC LIMIT 1)"
            ).format(changes, tags, project, change, sql.Literal("@" + dep.tag))
        return sql.SQL(
            "(SELECT change_id FROM {} WHERE project = {} AND change = {} ORDER BY committed_at ASC LIMIT 1)"
        ).format(changes, project, change)
    if dep.tag in ("HEAD", "ROOT"):
        order = sql.SQL("DESC" if dep.tag == "HEAD" else "ASC")
        return sql.SQL("(SELECT change_id FROM {} WHERE project = {} ORDER BY committed_at {} LIMIT 1)").format(
            changes, project, order
        )
    return sql.SQL("(SELECT change_id FROM {} WHERE project = {} AND tag = {})").format(
        tags, project, sql.Literal(f"@{dep.tag}")
    )


def _dependency_id(dep: Dependency, resolved: dict[str, str]) -> sql.Composable:
    """dependencies.dependency_id: Depend::resolved_id, which is NULL for a conflict and the id
    itself for a change of this project (Engine::check_deploy_dependencies)."""
    if dep.conflicts:
        return sql.SQL("NULL")
    if dep.is_local:
        return sql.Literal(resolved[dep.key_name])
    return _change_id_for(dep, resolved)


def _planned_at(timestamp: str) -> sql.Composable:
    return sql.SQL("{}::timestamptz").format(sql.Literal(timestamp))


def _tag_values(tag: PlannedTag, plan: Plan, who: _Committer) -> sql.Composable:
    return sql.SQL("({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, clock_timestamp())").format(
        sql.Literal(tag.id),
        sql.Literal(tag.format_name),
        sql.Literal(plan.project),
        sql.Literal(tag.change.id),
        sql.Literal(tag.note),
        who.name,
        who.email,
        _planned_at(tag.timestamp),
        sql.Literal(tag.planner_name),
        sql.Literal(tag.planner_email),
    )


_TAG_COLUMNS = sql.SQL(
    "tag_id, tag, project, change_id, note, committer_name, committer_email, planned_at, planner_name, "
    "planner_email, committed_at"
)


@dataclass
class _Script:
    parts: list[str] = field(default_factory=list)

    def add(self, *texts: str) -> None:
        self.parts.extend(texts)

    def statement(self, statement: sql.Composable) -> None:
        self.parts.append(_render(statement) + ";")


def _psql_quote(text: str) -> str:
    """A psql meta-command argument in single quotes."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _comment(text: str) -> str:
    return "\n".join("-- " + line if line else "--" for line in text.split("\n"))


def _header(plan: Plan, rendered: Sequence[PlannedChange], since: PlannedTag | None, to: PlannedTag | None) -> str:
    start = f"the changes after {since.format_name} ({since.change.name})" if since else "the start of the plan"
    end = f"{to.format_name} ({to.change.name})" if to else "the end of the plan"
    listing = "\n".join(
        f"  {change.index + 1:>3}. {change.name}  {change.deploy_file.name}  {change.id}" for change in rendered
    )
    return _comment(
        f"Sqitch project {plan.project}, rendered as one psql script by pginbox.schema.sqitch_script.\n"
        f"Plan:  {plan.file} (SHA-1 {plan.raw_sha1})\n"
        f"Range: from {start} through {end}: {len(rendered)} change(s), in plan order:\n"
        f"{listing}\n"
        "\n"
        "Apply it with psql 10 or later (it uses \\if and \\gset), connected as the role `sqitch deploy` would use:\n"
        "    psql -X -v ON_ERROR_STOP=1 -d DATABASE -f THIS_FILE        (or: ... -f - < THIS_FILE)\n"
        "For each change not yet deployed, the script runs the change's deploy script as written (it has\n"
        "its own BEGIN/COMMIT), then records the change in Sqitch's registry (schema sqitch, registry v1.1,\n"
        "created if absent) in a transaction of its own, exactly as `sqitch deploy` records it: afterwards\n"
        "sqitch status / log / verify / revert / deploy work on the database as if Sqitch had deployed it.\n"
        + (
            f"The database must be at {since.format_name} (or at a later change of this range);"
            if since
            else "The database must have no change of this project, or be at a change of this range;"
        )
        + " anything else is\n"
        "refused before any change runs. The script stops at the first error: the changes recorded before\n"
        "it stay deployed, and running the same file again continues after the last recorded change.\n"
        "Do not edit this file: render it again from the plan."
    )


def _preflight(
    plan: Plan,
    rendered: Sequence[PlannedChange],
    since: PlannedTag | None,
    who: _Committer,
    resolved: dict[str, str],
) -> sql.Composable:
    """One DO block: registry version, project registration, database state, dependencies."""
    changes, projects, releases = _table("changes"), _table("projects"), _table("releases")
    allowed = [c.id for c in rendered] + ([since.change.id] if since else [])
    missing_checks: list[sql.Composable] = []
    conflict_checks: list[sql.Composable] = []
    for change in rendered:
        pending = sql.SQL("NOT EXISTS (SELECT FROM {} WHERE change_id = {})").format(changes, sql.Literal(change.id))
        earlier = {c.id for c in rendered if c.index < change.index}
        for dep in change.requires:
            if dep.is_local and resolved[dep.key_name] in earlier:
                continue  # deployed by this script before the change that needs it
            missing_checks.append(
                sql.SQL("WHEN {} AND {} IS NULL THEN {}").format(
                    pending, _change_id_for(dep, resolved), sql.Literal(f"{change.name} requires {dep.as_string()}")
                )
            )
        for dep in change.conflicts:
            if dep.is_local and resolved[dep.key_name] in earlier:
                raise SqitchScriptError(
                    f'change "{change.name}" conflicts with "{dep.key_name}", which this script deploys '
                    "before it: fix the plan"
                )
            conflict_checks.append(
                sql.SQL("WHEN {} AND {} IS NOT NULL THEN {}").format(
                    pending,
                    _change_id_for(dep, resolved),
                    sql.Literal(f"{change.name} conflicts with {dep.as_string()}"),
                )
            )

    def problems(checks: list[sql.Composable]) -> sql.Composable:
        if not checks:
            return sql.SQL("NULL::text[]")
        return sql.SQL("ARRAY(SELECT p FROM (VALUES {}) AS c(p) WHERE p IS NOT NULL)").format(
            sql.SQL(",\n        ").join(sql.SQL("(CASE {} END)").format(check) for check in checks)
        )

    current_tags = [tag for change in [*([since.change] if since else []), *rendered] for tag in change.tags]
    log_new_tags: sql.Composable = sql.SQL("")
    if current_tags:
        # Engine::_sync_plan -> log_new_tags: the tags of the change the database is at.
        log_new_tags = sql.SQL(
            "    INSERT INTO {tags} ({columns})\n"
            "    SELECT v.* FROM (VALUES {values}) AS v({columns})\n"
            "     WHERE v.change_id = latest AND NOT EXISTS (SELECT FROM {tags} t WHERE t.tag_id = v.tag_id);\n"
        ).format(
            tags=_table("tags"),
            columns=_TAG_COLUMNS,
            values=sql.SQL(", ").join(_tag_values(tag, plan, who) for tag in current_tags),
        )

    expected = (
        f"at {since.format_name} ({since.change.name}) or at a later change up to the end of this script's range"
        if since
        else "without any change of this project, or at a change of this script's range"
    )
    hint = (
        "Render the script with since = the last tag this database has, or deploy with sqitch."
        if since
        else "Render the script with since = the last tag this database has (an upgrade), or deploy with sqitch."
    )
    return sql.SQL(
        """DO $pginbox_preflight$
DECLARE
    registry_version real;
    registered boolean;
    registered_uri text;
    latest text;
    latest_name text;
    missing text[];
    conflicting text[];
BEGIN
    IF pg_catalog.to_regclass('sqitch.releases') IS NULL THEN
        RAISE EXCEPTION 'the Sqitch registry in schema sqitch predates registry version 1.0'
            USING HINT = 'Run "sqitch upgrade" on this database first.';
    END IF;
    SELECT max(version) INTO registry_version FROM {releases};
    IF registry_version IS DISTINCT FROM {release}::real THEN
        RAISE EXCEPTION 'the Sqitch registry in schema sqitch is version %, this script writes version {release_text}',
            registry_version
            USING HINT = 'Run "sqitch upgrade" on this database (older registry) or use a newer pginbox.';
    END IF;
    LOCK TABLE {changes} IN EXCLUSIVE MODE;

    -- DBIEngine::register_project
    SELECT true, uri INTO registered, registered_uri FROM {projects} WHERE project = {project};
    IF registered AND registered_uri IS DISTINCT FROM {uri} THEN
        RAISE EXCEPTION 'project {project_text} is registered in this database with URI %, the plan says %',
            coalesce(registered_uri, 'NULL'), coalesce({uri}, 'NULL');
    ELSIF registered IS NULL THEN
        IF {uri} IS NOT NULL AND EXISTS (SELECT FROM {projects} WHERE uri = {uri}) THEN
            RAISE EXCEPTION 'cannot register project {project_text} with URI %: another project uses it', {uri};
        END IF;
        INSERT INTO {projects} (project, uri, creator_name, creator_email, created_at)
        VALUES ({project}, {uri}, {committer_name}, {committer_email}, clock_timestamp());
    END IF;

    -- Engine::_sync_plan: where the database is.
    SELECT change_id, change INTO latest, latest_name
      FROM {changes} WHERE project = {project} ORDER BY committed_at DESC LIMIT 1;
    IF latest IS NULL AND {need_state} THEN
        RAISE EXCEPTION 'this database has no change of project {project_text}; '
                        'this script upgrades a database at {since_text}'
            USING HINT = 'Render the script without since to deploy the whole plan.';
    END IF;
    IF latest IS NOT NULL AND latest <> ALL ({allowed}) THEN
        RAISE EXCEPTION 'this database is at change % (%), this script needs it {expected}', latest_name, latest
            USING HINT = {hint};
    END IF;
{log_new_tags}
    -- Engine::check_deploy_dependencies, for the changes still to deploy.
    missing := {missing};
    IF cardinality(missing) > 0 THEN
        RAISE EXCEPTION 'missing required changes: %', array_to_string(missing, '; ')
            USING HINT = 'Deploy the required changes (or projects) first.';
    END IF;
    conflicting := {conflicting};
    IF cardinality(conflicting) > 0 THEN
        RAISE EXCEPTION 'conflicts with previously deployed changes: %', array_to_string(conflicting, '; ')
            USING HINT = 'Revert the conflicting changes first.';
    END IF;
END
$pginbox_preflight$"""
    ).format(
        releases=releases,
        release=sql.Literal(REGISTRY_RELEASE),
        release_text=sql.SQL(REGISTRY_RELEASE),
        changes=changes,
        projects=projects,
        project=sql.Literal(plan.project),
        project_text=sql.SQL(_in_literal(plan.project)),
        uri=sql.SQL("{}::text").format(sql.Literal(plan.uri)),
        committer_name=who.name,
        committer_email=who.email,
        need_state=sql.SQL("true" if since else "false"),
        since_text=sql.SQL(_in_literal(since.format_name if since else "")),
        allowed=sql.SQL("{}::text[]").format(sql.Literal(allowed)),
        expected=sql.SQL(_in_literal(expected)),
        hint=sql.Literal(hint),
        log_new_tags=log_new_tags,
        missing=problems(missing_checks),
        conflicting=problems(conflict_checks),
    )


def _in_literal(text: str) -> str:
    """Text placed inside a single-quoted literal of a RAISE format (quotes doubled, % escaped)."""
    return text.replace("'", "''").replace("%", "%%")


def _change_rows(
    plan: Plan, change: PlannedChange, script_hash: str, who: _Committer, resolved: dict[str, str]
) -> Iterator[sql.Composable]:
    """DBIEngine::log_deploy_change and _log_event for one change."""
    yield sql.SQL(
        "INSERT INTO {} (change_id, script_hash, change, project, note, committer_name, committer_email,"
        " planned_at, planner_name, planner_email, committed_at)\n"
        "VALUES ({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, clock_timestamp())"
    ).format(
        _table("changes"),
        sql.Literal(change.id),
        sql.Literal(script_hash),
        sql.Literal(change.name),
        sql.Literal(plan.project),
        sql.Literal(change.note),
        who.name,
        who.email,
        _planned_at(change.timestamp),
        sql.Literal(change.planner_name),
        sql.Literal(change.planner_email),
    )
    if change.dependencies:
        yield sql.SQL("INSERT INTO {} (change_id, type, dependency, dependency_id)\nVALUES {}").format(
            _table("dependencies"),
            sql.SQL(",\n       ").join(
                sql.SQL("({}, {}, {}, {})").format(
                    sql.Literal(change.id),
                    sql.Literal("conflict" if dep.conflicts else "require"),
                    sql.Literal(dep.as_string()),
                    _dependency_id(dep, resolved),
                )
                for dep in change.dependencies
            ),
        )
    if change.tags:
        yield sql.SQL("INSERT INTO {} ({})\nVALUES {}").format(
            _table("tags"),
            _TAG_COLUMNS,
            sql.SQL(",\n       ").join(_tag_values(tag, plan, who) for tag in change.tags),
        )
    yield sql.SQL(
        "INSERT INTO {} (event, change_id, change, project, note, tags, requires, conflicts, committer_name,"
        " committer_email, planned_at, planner_name, planner_email, committed_at)\n"
        "VALUES ('deploy', {}, {}, {}, {}, {}::text[], {}::text[], {}::text[], {}, {}, {}, {}, {}, clock_timestamp())"
    ).format(
        _table("events"),
        sql.Literal(change.id),
        sql.Literal(change.name),
        sql.Literal(plan.project),
        sql.Literal(change.note),
        sql.Literal([tag.format_name for tag in change.tags]),
        sql.Literal([dep.as_string() for dep in change.requires]),
        sql.Literal([dep.as_string() for dep in change.conflicts]),
        who.name,
        who.email,
        _planned_at(change.timestamp),
        sql.Literal(change.planner_name),
        sql.Literal(change.planner_email),
    )


_INCLUDE_RE = re.compile(r"^[ \t]*\\(?:i|ir|include|include_relative)(?:[ \t]|$)", re.MULTILINE)


def _deploy_script(change: PlannedChange) -> tuple[str, str]:
    """(text, script_hash) of the change's deploy script."""
    path = change.deploy_file
    if not path.is_file():
        raise SqitchScriptError(
            f'deploy script of change "{change.name}" (plan line {change.line_number}) is missing: {path}'
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SqitchScriptError(f"{path} is not valid UTF-8 (byte {exc.start}): save it as UTF-8") from None
    if _INCLUDE_RE.search(text):
        raise SqitchScriptError(
            f"{path} includes other files (\\i or \\ir): the rendered script cannot resolve them; inline them"
        )
    return text, hashlib.sha1(raw).hexdigest()


def render_script(
    project_dir: Path,
    *,
    to: str | None = None,
    since: str | None = None,
    committer_name: str | None = None,
    committer_email: str | None = None,
) -> str:
    """One psql script deploying the Sqitch project in `project_dir` and recording it in Sqitch's
    registry, as `sqitch deploy` would.

    to:     a tag (with or without @): the last change deployed is the one carrying it; default: the
            end of the plan.
    since:  a tag: the script upgrades a database at that tag (or later within the range), and
            deploys only the changes after it; default: from the start of the plan.
    committer_name / committer_email: recorded as who deployed each change (and who installed the
            registry and registered the project); default: computed by the database at apply time
            (session_user, session_user@server-address).

    Raises SqitchScriptError for an unknown tag, `since` not before `to`, a missing or unreadable
    deploy script, a plan or sqitch.conf that cannot be parsed, or a dependency the plan cannot
    satisfy.
    """
    plan = read_plan(project_dir)
    if not plan.changes:
        raise SqitchScriptError(f"{plan.file} has no changes: nothing to render")
    to_tag = plan.tag(to) if to is not None else None
    since_tag = plan.tag(since) if since is not None else None
    last = to_tag.change.index if to_tag else len(plan.changes) - 1
    first = since_tag.change.index + 1 if since_tag else 0
    if first > last:
        assert since_tag is not None
        raise SqitchScriptError(
            f"since {since_tag.format_name} (change {since_tag.change.name}) is not before "
            + (f"to {to_tag.format_name} (change {to_tag.change.name})" if to_tag else "the end of the plan")
            + ": nothing to deploy between them; pick a later `to` or an earlier `since`"
        )
    rendered = plan.changes[first : last + 1]
    who = _committer(committer_name, committer_email)
    resolved: dict[str, str] = {}
    for change in plan.changes:
        for dep in change.dependencies:
            if dep.is_local and dep.change_id is None:
                index = plan.find(dep.key_name)
                assert index is not None  # checked by read_plan
                resolved[dep.key_name] = plan.changes[index].id
            elif dep.is_local and dep.change_id is not None:
                resolved[dep.key_name] = dep.change_id

    scripts = {change.id: _deploy_script(change) for change in rendered}
    hashes: dict[str, str] = {}
    for change in plan.changes[: last + 1]:
        digest = scripts[change.id][1] if change.id in scripts else None
        if digest is None:
            continue
        if digest in hashes:
            raise SqitchScriptError(
                f'the deploy scripts of "{hashes[digest]}" and "{change.name}" are identical: Sqitch\'s registry '
                "needs distinct scripts per project (a reworked change must differ from its earlier instance)"
            )
        hashes[digest] = change.name

    out = _Script()
    out.add(
        _header(plan, rendered, since_tag, to_tag),
        "",
        "\\set ON_ERROR_STOP on",
        "\\set QUIET on",
        "-- Sqitch runs every script with these psql variables set.",
        f"\\set registry {REGISTRY_SCHEMA}",
        "\\set tableopts ''",
        "SET client_encoding = 'UTF8';",
        "-- Every statement below runs with this search_path (pginbox deploy and the project's Sqitch",
        "-- client set it for each script too): nothing in public, or in any other schema of the",
        "-- deployer's path, can shadow a built-in that the scripts call unqualified.",
        SET_SEARCH_PATH,
        "",
        "-- Engine::pg::wait_lock: one deployment at a time (Sqitch takes the same advisory lock).",
        f"""DO $pginbox_lock$
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '{LOCK_WAIT}', true);
    PERFORM pg_catalog.pg_advisory_lock({ADVISORY_LOCK_KEY});
EXCEPTION WHEN lock_not_available THEN
    RAISE EXCEPTION 'another Sqitch deployment holds advisory lock {ADVISORY_LOCK_KEY} on this database'
        USING HINT = 'Wait for it to finish, then run this script again.';
END
$pginbox_lock$;""",
        "",
        "-- Engine::pg::initialize: the registry, when the database has none.",
        "SELECT NOT EXISTS (SELECT FROM pg_catalog.pg_tables WHERE schemaname = 'sqitch' AND tablename = 'changes')"
        " AS pginbox_registry_absent \\gset",
        "\\if :pginbox_registry_absent",
        "\\echo 'Adding registry tables to' :DBNAME",
        "-- App/Sqitch/Engine/pg.sql of Sqitch 1.3.1, verbatim:",
        _registry_ddl().rstrip("\n"),
        "-- DBIEngine::_register_release",
        "BEGIN;",
    )
    out.statement(
        sql.SQL(
            "INSERT INTO {} (version, installed_at, installer_name, installer_email)"
            " VALUES ({}, clock_timestamp(), {}, {})"
        ).format(_table("releases"), sql.Literal(REGISTRY_RELEASE), who.name, who.email)
    )
    out.add("COMMIT;", "\\endif", "")
    out.statement(_preflight(plan, rendered, since_tag, who, resolved))
    target = f"through {to_tag.format_name} " if to_tag else ""
    out.add("", f"\\echo {_psql_quote(f'Deploying changes {target}to')} :DBNAME", "")

    for change in rendered:
        text, script_hash = scripts[change.id]
        label = " ".join([change.name, *(tag.format_name for tag in change.tags)])
        out.add(
            "-- " + "-" * 96,
            f"-- change {change.index + 1}/{len(plan.changes)}: {label}  ({change.id})",
            f"-- deploy script: {change.deploy_file}",
            _render(
                sql.SQL("SELECT NOT EXISTS (SELECT FROM {} WHERE change_id = {}) AS pginbox_change_pending").format(
                    _table("changes"), sql.Literal(change.id)
                )
            )
            + " \\gset",
            "\\if :pginbox_change_pending",
            f"\\echo -n {_psql_quote(f'  + {label} .. ')}",
            text.rstrip("\n"),
            ";",
            "-- Sqitch runs each deploy script in a session of its own: leave nothing of it behind.",
            "RESET ALL;",
            "RESET SESSION AUTHORIZATION;",
            "RESET ROLE;",
            "SET client_encoding = 'UTF8';",
            SET_SEARCH_PATH,
            "-- DBIEngine::log_deploy_change",
            "BEGIN;",
            _render(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE;").format(_table("changes"))),
        )
        for statement in _change_rows(plan, change, script_hash, who, resolved):
            out.statement(statement)
        out.add(
            "COMMIT;",
            "\\echo ok",
            "\\else",
            f"\\echo {_psql_quote(f'  = {label} (already deployed)')}",
            "\\endif",
            "",
        )
    out.add(
        f"DO $pginbox_unlock$ BEGIN PERFORM pg_catalog.pg_advisory_unlock({ADVISORY_LOCK_KEY}); END $pginbox_unlock$;",
        "",
    )
    return "\n".join(out.parts)
