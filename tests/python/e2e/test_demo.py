"""`pginbox demo`: every act as a real subprocess (against a test database, and against the
embedded private cluster with no DSN at all), and the simulation's proof catching a broken
invariant."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from pginbox.cli import main
from pginbox.demo import act2_simulation as simulation
from pginbox.devtools.cluster import Cluster

INVARIANT_LINES = (
    "OK: every message applied at most once; every committed one exactly once.",  # act 1
    "no message id twice",
    "committed claims has its ledger row, and every ledger row its claim",
    "none lost",
    "every ledger row carries the payload its message was first sent with",
    "no double credit",
    "never applied",  # the conflict's amount
    "poison messages: quarantined, nothing applied",
    "broker drained",
    "INVARIANT HOLDS",
)


def pginbox_command() -> list[str]:
    script = Path(sys.executable).parent / "pginbox"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pginbox"]


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*pginbox_command(), "demo", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def assert_invariant_proven(output: str) -> None:
    for line in INVARIANT_LINES:
        assert line in output, f"{line!r} missing from:\n{output}"
    assert "FAILED" not in output
    assert "INVARIANT BROKEN" not in output


def counted(output: str, label: str) -> int:
    match = re.search(rf"^\s+{re.escape(label)}\s+(\d+)\s", output, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{output}"
    return int(match.group(1))


def test_demo_subprocess(db_dsn: str) -> None:
    result = run_demo("--messages", "300", "--workers", "3", "--seed", "7", "--dsn", db_dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Act 1:" in out and "Act 2: 300 messages" in out and "Act 3:" in out
    assert_invariant_proven(out)
    assert "OUTBOX PROMISE HOLDS" in out  # act 3 (tests/python/e2e/test_demo_outbox.py looks closer)
    # Act 1's attempts count up to the quarantine, crashed starts included (it printed attempts=0).
    crash = [line.split("->")[1].strip() for line in out.splitlines() if line.strip().startswith("m-5 ")]
    assert (
        crash
        == ["proceed  (attempts=1)", "proceed  (attempts=2)"]
        + [f"quarantined  (attempts=3, crashed=3, reason=crash_loop, quarantine #{crash[2].rsplit('#', 1)[1][:-1]})"]
        * 2
    ), crash
    assert re.search(r"^\s+delivered\s+\d+ \| applied\s+\d+ \| duplicates", out, re.MULTILINE)  # progress
    applied = counted(out, "applied")
    poison = counted(out, "poison messages quarantined")
    assert poison == 2 and applied == 300 - poison
    assert counted(out, "conflicts quarantined") >= 1
    assert counted(out, "deliveries") > 300
    assert counted(out, "duplicates absorbed") >= 1
    assert counted(out, "failures retried") >= poison  # each poison message failed before its quarantine

    # The database agrees with the printout: one ledger row per good message.
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT count(*), count(DISTINCT message_id) FROM pginbox_sim.ledger").fetchone()
    assert row == (applied, applied)


@pytest.mark.slow
def test_demo_on_the_private_cluster() -> None:
    """No DATABASE_URL, no --dsn: the demo starts a cluster of its own in PGINBOX_CLUSTER_DIR,
    deploys, runs; a second run reuses the cluster and the database. The cluster lives right under
    the system temporary directory, as make_cluster's do: another pytest session on the machine
    resets the modes of pytest's tree to 0700, and the server (the postgres OS user, as root)
    then cannot open a data directory there (seen in a parallel run)."""
    home = Path(tempfile.mkdtemp(prefix="pginbox-test-demo-"))
    home.chmod(0o755)
    datadir = home / "cluster"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PGINBOX_TEST_DSN_BASE")}
    env["PGINBOX_CLUSTER_DIR"] = str(datadir)
    try:
        first = run_demo("--messages", "300", "--workers", "3", env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "deploying schema inbox" in first.stdout
        assert_invariant_proven(first.stdout)
        assert (datadir / "PG_VERSION").is_file()
        assert Cluster(datadir).is_running()

        second = run_demo("--messages", "100", "--workers", "2", env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "deploying schema inbox" not in second.stdout
        assert_invariant_proven(second.stdout)
    finally:
        Cluster(datadir).destroy()
    assert not Cluster(datadir).is_running()
    shutil.rmtree(home, ignore_errors=True)


def test_the_proof_catches_a_double_credit(db_dsn: str) -> None:
    out = io.StringIO()
    sim = simulation.Simulation(db_dsn, simulation.SimulationSettings(messages=60, workers=2, seed=3), out)
    assert sim.run() is True
    assert "INVARIANT HOLDS" in out.getvalue()

    # Apply one message a second time behind the inbox's back.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pginbox_sim.ledger (message_id, account, amount) "
            "SELECT message_id, account, amount FROM pginbox_sim.ledger ORDER BY message_id LIMIT 1"
        )
        conn.execute(
            "UPDATE pginbox_sim.account a SET balance = balance + l.amount FROM "
            "(SELECT account, amount FROM pginbox_sim.ledger ORDER BY message_id LIMIT 1) l WHERE a.id = l.account"
        )
    out.seek(0)
    out.truncate()
    assert sim.prove(sim.collect()) is False
    text = out.getvalue()
    assert "FAILED ledger: 1 message ids applied more than once" in text
    assert re.search(r"FAILED account \d+: balance -?\d+, ledger -?\d+, sent -?\d+", text)
    assert "INVARIANT BROKEN" in text


def test_cli_exit_status_when_the_invariant_breaks(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulation, "run", lambda *args, **kwargs: False)
    result = CliRunner().invoke(main, ["demo", "--messages", "10", "--dsn", db_dsn])
    assert result.exit_code == 1
    assert "invariant is broken" in result.stderr
    assert "Traceback" not in result.output
