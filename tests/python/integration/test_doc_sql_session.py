"""docs/sql-api.md's example run (§2) replayed: every psql session of the page, in the order of
the run, on one fresh database, compared with what psql prints.

§2 says how the page's examples were run (psql `-X -a -v VERBOSITY=verbose -v SHOW_CONTEXT=never
-P null=∅`, `LOCATION:` lines and `psql:file:line:` prefixes removed) and that they ran in one run
on one database: what a session shows (quarantine ids, attempts, balances, hashes) depends on
every session before it. The run follows the page, except where the page says an example ran
elsewhere in the run; RUN lists it, with the steps the page tells in prose and does not show
(the example database of §2 and its `shipping` binding, "evt-11 had failed 5 times", "account A-9
has been created meanwhile", a second session holding a claim or a row lock). Sessions run as the
roles §2 names (consumer examples as docs_svc, operator examples as docs_ops, reader examples as
docs_ro) unless the page says otherwise. Where a session changes roles (`-- as d7_other:`) or the
prose tells a step in its middle, the session pauses there (Pause) and psql's output of its parts
is compared as one.

The transcripts of §6.9 (its first), §6.16 and §6.18 come from a scratch database with the roles
d7_svc, d7_other and d7_ops (SCRATCH_RUN, on a second fresh database).

Normalised, because they differ from run to run: psql's `Time:` figures (whether a statement took
a second or more stays compared) and timestamps (compared as offsets from the first one of the
line). The block of §6.18 cuts DETAIL and HINT lines the page showed before, as its note says.

The page's roles are cluster-wide and fixed by the page: the test shares an xdist_group, and
drops them afterwards.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
import pytest
from conftest import REPO_ROOT, create_database, drop_database, dsn_for
from helpers_docs import Block, blocks
from psycopg import sql
from test_doc_sql import as_script
from test_doc_sql import sql_blocks as sql_api_sql_blocks
from test_doc_sql_transcripts import PSQL_OPTIONS, statements

from pginbox.devtools.cluster import find_bindir

PAGE = REPO_ROOT / "docs" / "sql-api.md"  # docs/sql-api.md
THIS = "test_doc_sql_session.py"
ROLES = ("docs_svc", "docs_ops", "docs_ro", "d7_svc", "d7_other", "d7_ops")

pytestmark = pytest.mark.xdist_group("role_docs_svc")


COMMENTED_OUT = "the statements commented out below the line (`--   ALTER FUNCTION …`)"


@dataclass(frozen=True)
class Pause:
    """At this line of the session, `sql` runs as a superuser (a step the page tells in prose),
    then the session goes on as `then_as` (default: as before)."""

    line: str
    sql: str = ""
    then_as: str | None = None


@dataclass(frozen=True)
class Holder:
    """Another session, as `role`, that runs `sql` in a transaction and ends it (`commit`) once
    the session of the page has waited `seconds` for it."""

    sql: str
    role: str | None
    commit: bool
    seconds: float


@dataclass(frozen=True)
class Session:
    """A psql session of the page (found by the start of one of its lines), run as `role`."""

    line: str
    role: str = "docs_svc"
    pauses: tuple[Pause, ...] = ()
    holder: Holder | None = None
    timing: bool = False  # psql's \timing on
    cut_repeats: bool = False  # DETAIL/HINT lines shown before on the page are cut


@dataclass(frozen=True)
class Step:
    """What the page tells in prose and does not show, run as a superuser (or `role`)."""

    why: str
    sql: str
    role: str | None = None


# The handler made SECURITY DEFINER and owned by the consumer's role, as repair's rules require
# (§6.9, the HINT of its first transcript).
OWN_CREDIT = """
ALTER FUNCTION app.credit(jsonb, inbox.message_context) SECURITY DEFINER SET search_path = app, pg_temp;
ALTER FUNCTION app.credit(jsonb, inbox.message_context) OWNER TO {role};
GRANT USAGE ON SCHEMA app TO inbox_runner;
"""

EVT_11 = (
    """SELECT inbox.claim_and_apply('billing', 'orders', 'evt-11', 'credit', '{"account": "A-0", "amount": 10}');"""
)
SHIPPING = "SELECT inbox.bind_consumer('shipping', 'docs_svc', note => 'the consumer service');"
ORD_20 = """SELECT inbox.claim('shipping', 'orders', 'ord-20', '{"order": 20}')"""
ORD_21 = """SELECT inbox.claim('shipping', 'orders', 'ord-21', '{"order": 21}')"""
A_1_LOCKED = "SELECT FROM app.account WHERE account_id = 'A-1' FOR UPDATE"
CONFLICT_1 = (
    "SELECT outcome, quarantine_id, reason_code\n"
    """  FROM inbox.claim_and_apply('billing', 'orders', 'evt-1', 'credit', '{"account": "A-1", "amount": 250}');"""
)

# The run of §2, in its order: the page's, except the conflict of §6.1 (its prose says where it ran).
RUN: list[Session | Step] = [
    Step("§2: likewise for shipping", SHIPPING, "docs_ops"),
    Session('SELECT \'{"b":1,  "a":[1,2], "n":1e2'),
    Session("SELECT inbox._reason_code('23514', 'balance_not_negative') AS named_constraint,"),
    Session("  FROM inbox.claim('shipping', 'orders', 'ord-7', '{\"order\": 7, \"account\": \"A-2\""),
    Session(
        "SELECT outcome FROM inbox.claim('shipping', 'orders', 'ord-20',",
        holder=Holder(ORD_20, "docs_svc", True, 1.5),
        timing=True,
    ),
    Session("BEGIN ISOLATION LEVEL REPEATABLE READ;", holder=Holder(ORD_21, "docs_svc", True, 1.5)),
    Session("  FROM inbox.claim_bytea('shipping', 'legacy', 'L-1', "),
    Session("-- the broker redelivers (sent_at differs, but it is excluded from the hash)"),
    Session("-- the handler raises ... USING CONSTRAINT = 'unknown_account'"),
    Session("-- another session holds a row lock on account A-1", holder=Holder(A_1_LOCKED, None, False, 1.0)),
    Session("  FROM inbox.claim_and_apply_batch('billing', '["),
    Session("SELECT * FROM inbox.claim_and_apply_batch('billing', '[]');"),
    Session("SELECT outcome FROM inbox.claim('shipping', 'orders', 'ord-8', "),
    Session("-- evt-5: the first delivery killed the consumer before it recorded anything."),
    Session("SELECT outcome, attempts FROM inbox.record_start('billing', 'orders', 'evt-6');"),
    Session("SELECT outcome, attempts FROM inbox.record_start('billing', 'orders', 'evt-7');"),
    Session("-- as docs_ops\nSELECT quarantine_id AS id, message_id, reason_code,", role="docs_ops"),
    Session("  FROM inbox.register_handler('billing', 'credit',", role="docs_ops"),
    Session("SELECT inbox.register_handler('billing', 'credit', 'app.credit_text(text)', 'v1');", role="docs_ops"),
    Session("-- billing has processed messages with hash_exclude_keys", role="docs_ops"),
    Step("§6.9: app.credit made SECURITY DEFINER, owned by docs_svc", OWN_CREDIT.format(role="docs_svc")),
    Session(
        "  FROM inbox.repair(2, 'retry after the account import');",
        role="docs_ops",
        pauses=(Pause("-- (account A-9 has been created meanwhile)", "INSERT INTO app.account VALUES ('A-9', 0);"),),
    ),
    Session("  FROM inbox.discard(1, 'producer re-used evt-1;", role="docs_ops"),
    Session(CONFLICT_1),
    Session(
        "SELECT quarantine_id, kind, status, deliveries FROM inbox.quarantine WHERE quarantine_id = 1;", role="docs_ops"
    ),
    Step("§6.10: evt-11 had failed 5 times", EVT_11 * 4, "docs_svc"),
    Session("SELECT quarantine_id, kind, status FROM inbox.discard(6, ", role="docs_ops"),
    Session("  FROM inbox.claim_and_apply('billing', 'orders', 'evt-11', "),
    Session("  FROM inbox.release(3, 'crash fixed in consumer 2.4.1');", role="docs_ops"),
    Session("SELECT outcome FROM inbox.claim_and_apply('billing', 'orders', 'evt-5', "),
    Session("SELECT outcome, quarantine_id FROM inbox.claim('shipping', 'orders', 'ord-7', "),
    Session("SELECT inbox.release(7, 'let it through');", role="docs_ops"),
    Session("SELECT encode(inbox.payload_hash("),
    Session("SELECT * FROM inbox.schema_release();"),
    Session("SELECT * FROM inbox.configure_security(max_effect_delay => '400 days');", role="docs_ops"),
    Session(
        "SELECT consumer, tenant, producer, message_id, status, handler_version FROM inbox.message ", role="docs_ro"
    ),
    Session("SELECT inbox.claim('billing', 'orders', NULL, '{}');"),
    Session("SELECT inbox.discard(42, 'typo?');", role="docs_ops"),
]

SCRATCH = """
CREATE SCHEMA app;
CREATE TABLE app.account (
    account_id text PRIMARY KEY,
    balance numeric NOT NULL DEFAULT 0,
    CONSTRAINT balance_not_negative CHECK (balance >= 0)
);
INSERT INTO app.account VALUES ('A-1', 100), ('A-2', 0);
{credit}
GRANT USAGE ON SCHEMA app TO d7_svc, d7_ops;
GRANT SELECT, UPDATE ON app.account TO d7_svc, d7_ops;
"""
# §6.9's entry: consumer billing bound to d7_svc, max_attempts 1, d7_svc's delivery of r-1 failed
# for an account that was created afterwards.
R_1 = """
SELECT inbox.configure_consumer('billing', max_attempts => 1);
SELECT inbox.register_handler('billing', 'credit', 'app.credit(jsonb, inbox.message_context)'::regprocedure, 'v1');
SELECT inbox.bind_consumer('billing', 'd7_svc', note => 'billing service');
"""

SCRATCH_RUN: list[Session | Step] = [
    Step("§6.9: the handler", R_1, "d7_ops"),
    Step(
        "§6.9: d7_svc's delivery of r-1 failed",
        """SELECT inbox.claim_and_apply('billing', 'orders', 'r-1', 'credit', '{"account": "A-3", "amount": 1}');""",
        "d7_svc",
    ),
    Step("§6.9: the account created since", "INSERT INTO app.account VALUES ('A-3', 0);"),
    Session(
        "SELECT outcome FROM inbox.repair(1, 'after import');",
        role="d7_ops",
        pauses=(Pause("-- as a superuser:", COMMENTED_OUT, "d7_ops"),),
    ),
    Session(
        "SELECT consumer, tenants, legacy, bound_by, note FROM inbox.bind_consumer('billing', 'd7_svc',", role="d7_ops"
    ),
    Session(
        "SELECT outcome FROM inbox.claim('shipping', 'orders', 'ord-1', '{}', tenant => 'initech');",
        role="d7_svc",
        pauses=(Pause("-- as d7_other:", then_as="d7_other"),),
    ),
    Session("SELECT outcome FROM inbox.claim('billing', ' ', 'evt-2', '{}');", role="d7_svc", cut_repeats=True),
]


# ------------------------------------------------------------------------------ running psql


@dataclass
class Run:
    """One database's run: its conninfo, and the DETAIL/HINT lines the page has shown so far."""

    dsn: str
    shown: set[str] = field(default_factory=set)


def env(appname: str = "doc_sql_session") -> dict[str, str]:
    return {**os.environ, "PGTZ": "UTC", "PGCLIENTENCODING": "UTF8", "PGAPPNAME": appname}


def superuser(dsn: str, script: str, where: str, role: str | None = None) -> None:
    prefix = f"SET SESSION AUTHORIZATION {role};\n" if role else ""
    proc = subprocess.run(
        [str(find_bindir() / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=prefix + script,
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )
    assert proc.returncode == 0 and "ERROR" not in proc.stderr, f"{where}:\n{proc.stderr}"


def psql_command(dsn: str) -> list[str]:
    return [str(find_bindir() / "psql"), *PSQL_OPTIONS, "-d", dsn, "-f", "-"]


def prefix(role: str | None, timing: bool) -> tuple[str, list[str]]:
    """What the session runs first, unseen, and the lines psql prints for it."""
    script, printed = "", []
    if role:
        script += f"SET SESSION AUTHORIZATION {role};\n"
        printed += [f"SET SESSION AUTHORIZATION {role};", "SET"]
    if timing:
        script += "\\timing on\n"
        printed += ["\\timing on", "Timing is on."]
    return script, printed


def cleaned(stdout: str, printed: list[str]) -> list[str]:
    out = stdout.split("\n")
    assert out[: len(printed)] == printed, out[: len(printed)]
    out = out[len(printed) :]
    if out and not out[-1]:
        out.pop()  # the end of psql's last line: a part of a session ends there
    return [re.sub(r"^psql:<stdin>:\d+: ", "", line).rstrip() for line in out if not line.startswith("LOCATION:")]


def session(dsn: str, script: str, role: str | None, timing: bool = False) -> list[str]:
    first, printed = prefix(role, timing)
    proc = subprocess.run(
        psql_command(dsn),
        input=first + script,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        env=env(),
    )
    return cleaned(proc.stdout, printed)


def held_session(dsn: str, script: str, role: str | None, timing: bool, holder: Holder) -> list[str]:
    """The session runs while `holder` holds what it waits for; the holder ends its transaction
    `holder.seconds` after the session started waiting (seen in pg_stat_activity)."""
    appname = f"doc_sql_session_{os.getpid()}"
    with psycopg.connect(dsn) as held, psycopg.connect(dsn, autocommit=True) as watch:
        if holder.role:
            held.execute(sql.SQL("SET SESSION AUTHORIZATION {}").format(sql.Identifier(holder.role)))
        held.execute(holder.sql)
        first, printed = prefix(role, timing)
        with subprocess.Popen(
            psql_command(dsn),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(appname),
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(first + script)
            proc.stdin.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                waiting = watch.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                    (appname,),
                ).fetchone()
                if waiting:
                    break
                time.sleep(0.01)
            time.sleep(holder.seconds)
            if holder.commit:
                held.commit()
            else:
                held.rollback()
            stdout = proc.stdout.read()
            proc.wait(timeout=60)
    return cleaned(stdout, printed)


# ------------------------------------------------------------------------------ comparing


TIMING = re.compile(r"^Time: \d+\.\d{3} ms( \(\d\d:\d\d\.\d{3}\))?$")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\+00")


def normalised(line: str) -> str:
    """psql's timings (a second or more, or less), timestamps as offsets from the line's first."""
    timing = TIMING.match(line)
    if timing:
        return "Time: … ms" + (" (… s)" if timing.group(1) else "")
    stamps = TIMESTAMP.findall(line)
    for stamp in stamps:
        offset = datetime.fromisoformat(stamp) - datetime.fromisoformat(stamps[0])
        line = line.replace(stamp, f"<t0{offset.total_seconds():+}s>", 1)
    return line


def transcript(block: Block) -> list[str]:
    return [line.rstrip() for line in block.text.rstrip("\n").split("\n")]


def find(line: str) -> Block:
    found = [b for b in blocks(PAGE) if b.lang == "" and f"\n{line}" in f"\n{b.text}"]
    assert len(found) == 1, f"{line!r}: {len(found)} sessions of {PAGE.name} have a line that starts so"
    return found[0]


def script_parts(block: Block, step: Session) -> list[tuple[str, str | None, str]]:
    """(the statements of each part of the session, its role, what runs before it)."""
    lines = statements(block).rstrip("\n").split("\n")
    parts: list[tuple[str, str | None, str]] = []
    role: str | None = step.role
    before = ""
    start = 0
    for pause in step.pauses:
        at = lines.index(pause.line)
        parts.append(("\n".join(lines[start:at]) + "\n", role, before))
        before = pause.sql
        if before == COMMENTED_OUT:
            before = "\n".join(re.sub(r"^--\s+", "", line) for line in lines[at + 1 :] if line.startswith("--   "))
        role = pause.then_as or role
        start = at
    parts.append(("\n".join(lines[start:]) + "\n", role, before))
    return parts


def replay(run: Run, step: Session) -> str | None:
    """Runs one session of the page; what differs from the page, or None."""
    block = find(step.line)
    out: list[str] = []
    for script, role, before in script_parts(block, step):
        if before:
            superuser(run.dsn, before, f"{block.where}: before {script.split(chr(10))[0]}")
        if step.holder:
            out += held_session(run.dsn, script, role, step.timing, step.holder)
        else:
            out += session(run.dsn, script, role, step.timing)
    while out and not out[-1]:
        out.pop()
    if step.cut_repeats:
        kept = []
        for line in out:
            if re.match(r"^(DETAIL|HINT):", line) and line in run.shown:
                continue
            run.shown.add(line)
            kept.append(line)
        out = kept
    expected = transcript(block)
    run.shown.update(line for line in expected if re.match(r"^(DETAIL|HINT):", line))
    got = [normalised(line) for line in out]
    want = [normalised(line) for line in expected]
    if got == want:
        return None
    diff = difflib.unified_diff(want, got, f"{block.where} (the page)", "psql", lineterm="")
    return "\n".join(diff)


def replay_all(run: Run, steps: list[Session | Step]) -> list[str]:
    found = []
    for step in steps:
        if isinstance(step, Step):
            superuser(run.dsn, step.sql, step.why, step.role)
            continue
        problem = replay(run, step)
        if problem:
            found.append(problem)
    return found


# ------------------------------------------------------------------------------ the test


def drop_roles(pg_base: str, dsns: list[str]) -> None:
    names = sql.SQL(", ").join(sql.Identifier(r) for r in ROLES)
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as admin:
            found = admin.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (list(ROLES),)).fetchall()
            if found:
                owners = sql.SQL(", ").join(sql.Identifier(r) for (r,) in found)
                admin.execute(sql.SQL("DROP OWNED BY {}").format(owners))
    with psycopg.connect(dsn_for(pg_base, "postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(names))


@pytest.fixture
def scratch_dsn(pg_base: str, template_db: str, db_dsn: str) -> Iterator[str]:
    name = f"{psycopg.conninfo.conninfo_to_dict(db_dsn)['dbname']}_scratch"
    create_database(pg_base, name, template=template_db)
    drop_roles(pg_base, [])
    try:
        yield dsn_for(pg_base, name)
    finally:
        try:
            drop_roles(pg_base, [db_dsn, dsn_for(pg_base, name)])
        finally:
            drop_database(pg_base, name)


def test_the_example_run_of_section_2(db_dsn: str, scratch_dsn: str) -> None:
    (setup, *_) = sql_api_sql_blocks("docs/sql-api.md")
    superuser(db_dsn, as_script(setup), setup.where)
    found = replay_all(Run(db_dsn), RUN)

    credit = re.search(r"^CREATE FUNCTION app\.credit\(.*?^END \$\$;$", setup.text, re.S | re.M)
    assert credit, setup.where
    superuser(
        scratch_dsn,
        "".join(f"CREATE ROLE {r} LOGIN;\n" for r in ("d7_svc", "d7_other", "d7_ops"))
        + "GRANT inbox_consumer TO d7_svc, d7_other; GRANT inbox_operator TO d7_ops;\n"
        + SCRATCH.format(credit=credit.group(0)),
        "the scratch database",
    )
    found += replay_all(Run(scratch_dsn), SCRATCH_RUN)
    assert not found, "\n\n".join(found)


def test_every_session_of_the_page_is_replayed() -> None:
    """The sessions whose marker names this file are the ones RUN and SCRATCH_RUN replay."""
    replayed = {find(s.line).line for s in [*RUN, *SCRATCH_RUN] if isinstance(s, Session)}
    marked = {b.line for b in blocks(PAGE) if b.lang == "" and b.marker is not None and THIS in b.marker}
    assert replayed == marked
