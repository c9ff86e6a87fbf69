"""Running a command on a pseudo-terminal, the way an operator runs it by hand."""

from __future__ import annotations

import os
import pty
import subprocess
import time


def run_on_a_terminal(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    """Runs argv with stdin, stdout and stderr on a pseudo-terminal; its exit status and output."""
    master, slave = pty.openpty()
    with subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave) as proc:
        os.close(slave)
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        status = proc.wait(timeout=10)
    return status, b"".join(chunks).decode("utf-8", errors="replace")


def frames(output: str) -> list[str]:
    """The lines drawn in place (each starts with CR and erase-line), and the plain lines."""
    return [frame for part in output.split("\r\x1b[K") for frame in part.splitlines() if frame.strip()]
