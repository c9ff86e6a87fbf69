"""Every example of docs/operations.md, run: each `pginbox ...` line of its sh blocks against a real
database (the destinations file pointing at the real RabbitMQ and NATS), and each transcript of its
text blocks compared with what the command prints now."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import nats
import nats.js.errors
import psycopg
import pytest
from click.testing import CliRunner, Result
from helpers_brokers import NATS_URL, RABBIT_URL, require
from psycopg.conninfo import conninfo_to_dict

from pginbox import __version__
from pginbox.cli import main

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"
Conn = psycopg.Connection[tuple[Any, ...]]


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.DOTALL)


def commands() -> list[list[str]]:
    out = []
    for block in blocks("sh"):
        for line in block.splitlines():
            if line.startswith("pginbox "):
                words = shlex.split(line, comments=True)
                out.append(words[1:])
    return out


def run(args: list[str], dsn: str | None) -> Result:
    argv = (["--dsn", dsn] if dsn else []) + list(args)  # the global --dsn: provision takes none of its own
    return CliRunner().invoke(main, argv, catch_exceptions=True)


@pytest.fixture
def brokers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    require("rabbitmq")
    require("nats")
    tag = tmp_path.name[-8:].replace("-", "_") + "_" + str(id(tmp_path))[-6:]
    names = {"queue": f"t_docops_{tag}", "subject": f"t_docops_{tag}.mail", "stream": f"T_DOCOPS_{tag}".upper()}
    (tmp_path / "destinations.toml").write_text(
        f'[destinations.mail]\nurl = "{RABBIT_URL}"\nrouting_key = "{names["queue"]}"\n\n'
        f'[destinations.events]\nurl = "{NATS_URL}"\nsubject = "{names["subject"]}"\nstream = "{names["stream"]}"\n'
    )
    monkeypatch.chdir(tmp_path)
    yield names

    async def clean() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        async with connection:
            await (await connection.channel()).queue_delete(names["queue"])
        nc = await nats.connect(NATS_URL)
        try:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jetstream().delete_stream(names["stream"])
        finally:
            await nc.close()

    asyncio.run(clean())


def test_every_sh_example_runs(conn: Conn, db_dsn: str, brokers: dict[str, str]) -> None:
    conn.execute("SELECT inbox.bind_destination('mail', '*', 'doc')")
    for n in range(3):
        conn.execute("SELECT inbox.enqueue_effect(%s, 'mail', '{}'::jsonb)", (f"doc-{n}",))
    conn.execute("UPDATE inbox.outbox SET status = 'dead', dead_reason = 'max_attempts', attempts = 8")
    ran = commands()
    assert len(ran) >= 8, ran
    for args in ran:
        result = run(args, db_dsn)
        assert "Traceback" not in result.output and "Error" not in result.output, (args, result.output)
        if args[0] == "doctor":
            # three dead effects: a problem (exit 2), then none once the redrives below ran
            assert result.exit_code in (0, 1, 2), (args, result.output)
        elif args[:2] == ["outbox", "provision"] and "--check" in args:
            assert result.exit_code == 2 and "missing" in result.stdout, (args, result.output)
        else:
            assert result.exit_code == 0, (args, result.output)
        if args[:2] == ["outbox", "redrive"] and "--dry-run" in args:
            assert "3 dead effects would be redriven" in result.stdout
        elif args[:2] == ["outbox", "redrive"] and "--destination" in args:
            assert "redrove 3 of 3 dead effects" in result.stdout
    doctor = run(["doctor"], db_dsn)
    assert doctor.exit_code != 2, "the redrives of the doc left no dead effect"
    again = run(["outbox", "provision", "--config", "destinations.toml", "--check"], None)
    assert again.exit_code == 0, again.output


def test_the_transcripts_are_what_the_commands_print(conn: Conn, db_dsn: str, login_role: Callable[..., str]) -> None:
    transcripts = blocks("text")
    version = next(b for b in transcripts if b.startswith("pginbox 0"))
    assert run(["--version"], None).stdout == version.replace("0.3.0.dev0", __version__)

    service_dsn = login_role("inbox_consumer")
    user = str(conninfo_to_dict(service_dsn)["user"])
    stats = next(b for b in transcripts if b.startswith("$ pginbox stats"))
    expected = "\n".join(stats.splitlines()[1:]).replace("billing_service", user) + "\n"
    assert run(["stats"], service_dsn).stderr == expected

    # The repair refusal: a SECURITY INVOKER handler, a consumer bound to its service.
    service = str(conninfo_to_dict(login_role("inbox_consumer"))["user"])
    conn.execute(
        "CREATE FUNCTION credit(payload jsonb) RETURNS void LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'no' USING CONSTRAINT = 'unknown_account'; END $$"
    )
    conn.execute("SELECT inbox.register_handler('billing', 'credit', 'credit(jsonb)'::regprocedure, 'v1')")
    conn.execute("SELECT inbox.configure_consumer('billing', max_attempts => 1)")
    conn.execute("SELECT inbox.bind_consumer('billing', %s::regrole, note => 'doc')", (service,))
    row = conn.execute(
        "SELECT quarantine_id FROM inbox.claim_and_apply('billing', 'shop', 'm-1', 'credit', '{}'::jsonb)"
    ).fetchone()
    assert row is not None and row[0] is not None
    repair = next(b for b in transcripts if b.startswith("$ pginbox quarantine repair"))
    expected = (
        "\n".join(repair.splitlines()[1:]).replace("entry 7", f"entry {row[0]}").replace("billing_service", service)
        + "\n"
    )
    result = run(["quarantine", "repair", str(row[0]), "--note", "fixed in v2"], login_role("inbox_operator"))
    assert result.exit_code == 1 and result.stderr == expected, result.stderr
