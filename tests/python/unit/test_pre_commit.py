""".pre-commit-config.yaml runs the static checks of tests/run, the same commands: a check added to
one and not the other fails here (no database needed)."""

from __future__ import annotations

import shlex

import yaml
from conftest import REPO_ROOT

ROOT = REPO_ROOT
VENV_BIN = ".venv/bin/"
#: The tools whose commands in tests/run are static checks (the rest start clusters and run tests).
STATIC = ("ruff", "mypy", "python python/tools/")


def hook_commands() -> dict[str, str]:
    """{hook id: its command as tests/run spells it (the tools on PATH, not in .venv/bin)}."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    commands = {}
    for repo in config["repos"]:
        assert repo["repo"] == "local", "the hooks use the project's own tools (.venv), not pre-commit's copies"
        for hook in repo["hooks"]:
            assert hook["language"] == "system" and hook["pass_filenames"] is False, hook["id"]
            words = shlex.split(hook["entry"])
            assert words[0].startswith(VENV_BIN), f"{hook['id']}: run the .venv tool ({VENV_BIN}...)"
            words[0] = words[0].removeprefix(VENV_BIN)
            commands[hook["id"]] = shlex.join(words)
    return commands


def run_static_checks() -> set[str]:
    """The static-check command lines of tests/run."""
    lines = (line.strip() for line in (ROOT / "tests" / "run").read_text().splitlines())
    return {line for line in lines if line.startswith(STATIC)}


def test_every_hook_is_a_check_of_tests_run() -> None:
    checks = run_static_checks()
    for hook, command in hook_commands().items():
        assert command in checks, f"hook {hook} runs `{command}`, which tests/run does not"


def test_every_static_check_of_tests_run_is_a_hook() -> None:
    checks = run_static_checks()
    assert len(checks) == 5, checks  # async_to_sync, ruff check, ruff format, mypy, sync_deploy
    assert checks == set(hook_commands().values())
