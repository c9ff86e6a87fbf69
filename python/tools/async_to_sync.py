#!/usr/bin/env python3
"""Write the sync twin of each asyncio module: AsyncInbox is the source, Inbox is generated.

    python python/tools/async_to_sync.py            regenerate every output
    python python/tools/async_to_sync.py --check    exit 1 (and show a diff) when an output is stale

Modelled on psycopg's tools/async_to_sync.py, but token-based instead of AST-based: the output
keeps the source's layout and comments line for line, so the two files read side by side.

The conversion, in order:

1. Directive blocks (comment lines `# @ async`, `# @ sync`, `# @ end`: the spelling `ruff format`
   gives them), for the few places where the two flavours cannot be written the same way:

       # @ async: why
       ...lines only the async module has...
       # @ sync
       # ...the lines the sync module has instead, commented out (taken as they are, not renamed)
       # @ end

   The `# @ sync` part is optional. The async module runs and is type-checked as written; the sync
   lines are checked when the generated module is (ruff and mypy run over both).
2. Tokens: `async` before def/with/for and every `await` are dropped; `Awaitable[X]` becomes `X`;
   names, attributes and dotted names are renamed by NAMES and DOTTED; identifiers inside strings,
   docstrings and comments by TEXT.
3. `ruff check --fix-only --select I,F401,SIM117` sorts the imports the renames reordered, drops
   the ones only the async module used, and joins the `with` statements the async module had to
   nest (a sync and an async context manager); it is the `ruff` of the environment (a dev
   dependency).
4. A header says where the file came from, and `ruff format` lays the result out, so that the
   generated module is what `ruff format --check` expects (the async sources are formatted too).
"""

from __future__ import annotations

import argparse
import difflib
import io
import keyword
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (source, output), relative to the repository root.
FILES: Sequence[tuple[str, str]] = (
    ("python/pginbox/client/async_inbox.py", "python/pginbox/client/inbox.py"),
    ("tests/python/integration/test_library_async.py", "tests/python/integration/test_library.py"),
    ("tests/python/_library_child_async.py", "tests/python/_library_child.py"),
    ("python/pginbox/integrations/sqlalchemy_async.py", "python/pginbox/integrations/sqlalchemy.py"),
    ("python/pginbox/ops/handler_run_async.py", "python/pginbox/ops/handler_run.py"),
    ("python/pginbox/ops/granted_repair_async.py", "python/pginbox/ops/granted_repair.py"),
    ("python/pginbox/ops/python_replay_async.py", "python/pginbox/ops/python_replay.py"),
)

#: Names and attributes. The choices that are not a mere "Async" prefix say why.
NAMES: dict[str, str] = {
    "AsyncInbox": "Inbox",
    "AsyncHandler": "Handler",
    "AsyncConnection": "Connection",
    "AsyncConnectionPool": "ConnectionPool",
    # SQLAlchemy's asyncio flavour (pginbox.integrations.sqlalchemy_async)
    "AsyncSession": "Session",
    "AsyncSQLAlchemyInbox": "SQLAlchemyInbox",
    "AsyncSQLAlchemyHandler": "SQLAlchemyHandler",
    "AsyncCursor": "Cursor",
    "AsyncPipeline": "Pipeline",
    "AsyncIterator": "Iterator",
    "asynccontextmanager": "contextmanager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "AConn": "Conn",
    # the protocol's drivers (pginbox.client.drive)
    "drive_async": "drive",
    # asyncio.Lock -> threading.Lock: the sync client serializes callers of one connection across
    # threads; `import asyncio` becomes `import threading` (asyncio.sleep is renamed as a whole below).
    "asyncio": "threading",
    # tests: the helpers of tests/python/acompat.py that have a sync twin, and the module names.
    "aconnect": "connect",
    "agather": "gather",
    "abarrier_once": "barrier_once",
    "ACursor": "Cursor",
    "_library_child_async": "_library_child",
    # the operator paths' handler runner (pginbox.ops.handler_run) and its module
    "AsyncHandlerRun": "HandlerRun",
    "handler_run_async": "handler_run",
}

#: Dotted names renamed as a whole (before NAMES); the async module imports what they need
#: (`time` for time.sleep).
DOTTED: dict[str, str] = {
    "asyncio.sleep": "time.sleep",
    "psycopg.AsyncConnection.connect": "psycopg.connect",
}

#: Identifiers renamed inside strings and comments (whole words).
TEXT: dict[str, str] = {
    "AsyncInbox": "Inbox",
    "AsyncSQLAlchemyInbox": "SQLAlchemyInbox",
    "AsyncSQLAlchemyHandler": "SQLAlchemyHandler",
    "AsyncSession": "Session",
    "AsyncSessions": "Sessions",
    "create_async_engine": "create_engine",
    "AsyncConnections": "Connections",
    "AsyncHandler": "Handler",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "asyncio.Lock": "threading.Lock",
    "_library_child_async": "_library_child",
    "test_library_async": "test_library",
}

_TEXT_RE = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(TEXT, key=len, reverse=True)) + r")\b")
_DIRECTIVE = re.compile(r"^(\s*)# ?@ ?(async|sync|end)\b")
_SCRIPT = "python/tools/async_to_sync.py"


class ConversionError(Exception):
    pass


@dataclass
class _Edit:
    start: tuple[int, int]  # (row from 1, column)
    end: tuple[int, int]
    text: str


def _blocks(lines: list[str], name: str) -> tuple[list[str], set[int]]:
    """Lines of the sync module after the directive blocks, and the (0-based) indices of the lines
    that came from `# @ sync` parts (kept as they are)."""
    out: list[str] = []
    verbatim: set[int] = set()
    mode = None  # None | "async" | "sync"
    for number, line in enumerate(lines, start=1):
        found = _DIRECTIVE.match(line)
        if found:
            word = found.group(2)
            allowed = {"async": (None,), "sync": ("async",), "end": ("async", "sync")}[word]
            if mode not in allowed:
                raise ConversionError(f"{name}:{number}: `# @ {word}` where a block is {mode or 'not'} open")
            mode = None if word == "end" else word
            continue
        if mode == "async":
            continue
        if mode == "sync":
            stripped = line.lstrip()
            if not stripped.startswith("#"):
                raise ConversionError(f"{name}:{number}: lines of a `# @ sync` part are comments")
            indent = line[: len(line) - len(stripped)]
            code = stripped[1:]
            verbatim.add(len(out))
            out.append(indent + (code[1:] if code.startswith(" ") else code))
            continue
        out.append(line)
    if mode is not None:
        raise ConversionError(f"{name}: a `# @ {mode}` block is not closed with `# @ end`")
    return out, verbatim


def _matching_bracket(tokens: list[tokenize.TokenInfo], start: int) -> int:
    depth = 0
    for index in range(start, len(tokens)):
        if tokens[index].type == tokenize.OP and tokens[index].string in "([{":
            depth += 1
        elif tokens[index].type == tokenize.OP and tokens[index].string in ")]}":
            depth -= 1
            if depth == 0:
                return index
    raise ConversionError("unbalanced brackets")


def _grouping_only(tokens: list[tokenize.TokenInfo], at: int) -> int | None:
    """When `await` at `at` opens a parenthesized group that holds nothing but one primary
    (a name followed by attributes, calls and subscripts), the index of the closing parenthesis."""
    before = tokens[at - 1] if at > 0 else None
    if before is None or before.string != "(":
        return None
    called = tokens[at - 2] if at > 1 else None
    if called is not None and (
        (called.type == tokenize.NAME and not keyword.iskeyword(called.string)) or called.string in (")", "]")
    ):
        return None  # a call's parentheses, not a group
    i = at + 1
    if tokens[i].type != tokenize.NAME:
        return None
    i += 1
    while True:
        if tokens[i].string == "." and tokens[i + 1].type == tokenize.NAME:
            i += 2
        elif tokens[i].string in ("(", "["):
            i = _matching_bracket(tokens, i) + 1
        else:
            break
    return i if tokens[i].string == ")" else None


def _edits(tokens: list[tokenize.TokenInfo], verbatim: set[int]) -> Iterator[_Edit]:
    skip_until = -1
    for i, tok in enumerate(tokens):
        if i <= skip_until or tok.start[0] - 1 in verbatim:
            continue
        following = tokens[i + 1] if i + 1 < len(tokens) else tok
        is_async_keyword = tok.string == "async" and following.string in ("def", "with", "for")
        if tok.type == tokenize.NAME and (tok.string == "await" or is_async_keyword):
            yield _Edit(tok.start, following.start, "")
            if tok.string == "await" and (close := _grouping_only(tokens, i)) is not None:
                # `(await f(x)).attr` -> `f(x).attr`: the parentheses only made room for `await`
                yield _Edit(tokens[i - 1].start, tokens[i - 1].end, "")
                yield _Edit(tokens[close].start, tokens[close].end, "")
        elif tok.type == tokenize.NAME and tok.string == "Awaitable" and following.string == "[":
            close = _matching_bracket(tokens, i + 1)
            yield _Edit(tok.start, following.end, "")
            yield _Edit(tokens[close].start, tokens[close].end, "")
        elif tok.type == tokenize.NAME:
            dotted, last = tok.string, i
            while last + 2 < len(tokens) and tokens[last + 1].string == "." and tokens[last + 2].type == tokenize.NAME:
                dotted, last = f"{dotted}.{tokens[last + 2].string}", last + 2
                if dotted in DOTTED:
                    yield _Edit(tok.start, tokens[last].end, DOTTED[dotted])
                    skip_until = last
                    break
            else:
                if tok.string in NAMES:
                    yield _Edit(tok.start, tok.end, NAMES[tok.string])
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            renamed = _TEXT_RE.sub(lambda m: TEXT[m.group(1)], tok.string)
            if renamed != tok.string:
                yield _Edit(tok.start, tok.end, renamed)


def _apply(lines: list[str], edits: list[_Edit]) -> list[str]:
    text = "".join(lines)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(position: tuple[int, int]) -> int:
        return offsets[position[0] - 1] + position[1]

    for edit in sorted(edits, key=lambda e: at(e.start), reverse=True):
        text = text[: at(edit.start)] + edit.text + text[at(edit.end) :]
    return text.splitlines(keepends=True)


def _ruff(arguments: Sequence[str], source: str, output: Path) -> str:
    """`source` through `ruff <arguments>`, configured as the file `output` would be."""
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff) if ruff.is_file() else "ruff", *arguments, "--stdin-filename", str(output), "-"]
    done = subprocess.run(command, input=source, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise ConversionError(f"ruff {arguments[0]} failed on {output}: {done.stderr.strip()}")
    return done.stdout


def _ruff_fix(source: str, output: Path) -> str:
    fixed = _ruff(["check", "--fix-only", "--exit-zero", "--quiet", "--select", "I,F401,SIM117"], source, output)
    return _ruff(["format", "--quiet"], fixed, output)


def convert(source: str, name: str, output: Path) -> str:
    """The sync module generated from the async module `source` (named `name` in messages)."""
    lines, verbatim = _blocks(source.splitlines(keepends=True), name)
    tokens = list(tokenize.generate_tokens(io.StringIO("".join(lines)).readline))
    converted = "".join(_apply(lines, list(_edits(tokens, verbatim))))
    header = (
        f"# Generated from {Path(name).name} by {_SCRIPT}: DO NOT EDIT.\n"
        f"# Edit {name}, then run the script (tests/run checks this file).\n"
    )
    return _ruff_fix(header + converted, output)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when an output is stale")
    args = parser.parse_args(argv)
    stale = 0
    for source_name, output_name in FILES:
        source, output = ROOT / source_name, ROOT / output_name
        try:
            wanted = convert(source.read_text(encoding="utf-8"), source_name, output)
        except (ConversionError, tokenize.TokenError, SyntaxError) as exc:
            print(f"async_to_sync: {exc}", file=sys.stderr)
            return 2
        current = output.read_text(encoding="utf-8") if output.exists() else ""
        if current == wanted:
            continue
        if args.check:
            stale += 1
            diff = difflib.unified_diff(
                current.splitlines(keepends=True),
                wanted.splitlines(keepends=True),
                f"{output_name} (on disk)",
                f"{output_name} (generated from {source_name})",
            )
            sys.stderr.writelines(diff)
        else:
            output.write_text(wanted, encoding="utf-8")
            print(f"wrote {output_name}")
    if stale:
        print(f"async_to_sync: {stale} generated file(s) out of date: run python {_SCRIPT}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
