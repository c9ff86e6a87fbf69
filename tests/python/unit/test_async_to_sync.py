"""python/tools/async_to_sync.py: the generated sync modules are up to date, `--check` fails on
drift, and each rule of the conversion does what its docstring says (no database needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from helpers_tools import load_tool

ROOT = REPO_ROOT

tool = load_tool("async_to_sync")


def test_generated_files_are_up_to_date() -> None:
    assert tool.main(["--check"]) == 0


def test_check_fails_on_drift(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "thing_async.py"
    output = tmp_path / "thing.py"
    source.write_text('"""AsyncInbox."""\n\n\nasync def f() -> None:\n    await g()\n')
    monkeypatch.setattr(tool, "FILES", [(str(source), str(output))])
    assert tool.main(["--check"]) == 1  # missing
    assert tool.main([]) == 0 and "def f() -> None:\n    g()\n" in output.read_text()
    assert tool.main(["--check"]) == 0
    output.write_text(output.read_text() + "# edited by hand\n")
    assert tool.main(["--check"]) == 1
    assert "edited by hand" in capsys.readouterr().err


def test_conversion_rules() -> None:
    source = '''"""AsyncInbox on psycopg.AsyncConnection."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import psycopg

# @ async: only here
ASYNC_ONLY = 1
# @ sync
# SYNC_ONLY = psycopg.AsyncConnection
# @ end


@asynccontextmanager
async def opened(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[object]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:  # an AsyncConnection
        yield conn


async def run(step: Callable[[], Awaitable[int]]) -> int:
    await asyncio.sleep(time.monotonic() * 0)
    return (await step()).real
'''
    out = tool.convert(source, "tests/python/x_async.py", ROOT / "tests" / "python" / "x.py")
    assert out.startswith("# Generated from x_async.py by python/tools/async_to_sync.py: DO NOT EDIT.\n")
    assert '"""Inbox on psycopg.Connection."""' in out
    assert "ASYNC_ONLY" not in out and "SYNC_ONLY = psycopg.AsyncConnection\n" in out
    assert "@contextmanager\ndef opened(dsn: str) -> Iterator[psycopg.Connection[object]]:" in out
    assert "    with psycopg.connect(dsn) as conn:  # an Connection\n" in out
    assert (
        "def run(step: Callable[[], int]) -> int:\n    time.sleep(time.monotonic() * 0)\n    return step().real\n"
    ) in out
    assert "import time\n" in out and "asyncio" not in out and "Awaitable" not in out


def test_unbalanced_directives_are_refused() -> None:
    with pytest.raises(tool.ConversionError, match="not closed"):
        tool.convert("# @ async\nx = 1\n", "x_async.py", ROOT / "x.py")
    with pytest.raises(tool.ConversionError, match="# @ sync"):
        tool.convert("# @ sync\n# x = 1\n# @ end\n", "x_async.py", ROOT / "x.py")


def ruff_format(text: str, filename: Path) -> str:
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run(
        [str(ruff) if ruff.is_file() else "ruff", "format", "--stdin-filename", str(filename), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return done.stdout


def test_output_is_laid_out_by_ruff_format() -> None:
    """Dropping `await` shortens lines: the generated module is re-laid out, so that `ruff format --check`
    passes over it as over every other file."""
    call = "await connection.execute(" + ", ".join(f"argument_{n}" for n in range(8)) + ")"
    source = ruff_format(f"async def f(connection: object) -> None:\n    {call}\n", ROOT / "x_async.py")
    assert "(\n" in source  # too long for one line with the await
    out = tool.convert(source, "x_async.py", ROOT / "x.py")
    assert "    connection.execute(argument_0," in out  # one line again without it
    assert ruff_format(out, ROOT / "x.py") == out


def test_directives_survive_ruff_format() -> None:
    """`ruff format` puts a blank after `#`: the directives are read in that spelling (and the older `#@`)."""
    source = "#@ async: only here\nw = 1\n#@ sync\n# y = 2\n#@ end\nx = 1\n"
    formatted = ruff_format(source, ROOT / "x_async.py")
    assert "# @ async: only here\n" in formatted and "# @ end\n" in formatted
    for text in (source, formatted):
        out = tool.convert(text, "x_async.py", ROOT / "x.py")
        assert "w = 1" not in out and "y = 2\nx = 1\n" in out
