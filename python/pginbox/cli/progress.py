"""Progress of long operator commands (`pginbox purge`, `pginbox replay run`) on stderr: drawn in
place on a terminal (and redrawn every second, so a wait is seen waiting), never under cron;
--progress forces it (one line per step when stderr is not a terminal), --no-progress and --quiet
turn it off."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "Render", "duration", "progress_for_stderr"]

#: Draws one progress line from the seconds since the operation began.
Render = Callable[[float], str]


def duration(seconds: float) -> str:
    """42s, 3m05s, 2h10m."""
    whole = max(round(seconds), 0)
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    if whole >= 60:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole}s"


class Progress:
    """One progress line on `stream`: in place on a terminal, else one line per step."""

    def __init__(self, stream: TextIO, in_place: bool) -> None:
        self.stream = stream
        self.in_place = in_place
        self.lock = threading.Lock()
        self.render: Render | None = None
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="pginbox-progress", daemon=True)

    def begin(self, render: Render) -> None:
        """An operation starts: its clock starts, its first line is drawn (on a terminal)."""
        with self.lock:
            self.started = time.monotonic()
            self.render = render
            if self.in_place:
                self._draw()
        if self.in_place and not self.ticker.is_alive():
            self.ticker.start()

    def show(self, render: Render) -> None:
        """A step is done: draw its line."""
        with self.lock:
            self.render = render
            self._draw()

    def clear(self) -> None:
        """The operation is over (a summary line follows): the progress line goes."""
        with self.lock:
            self.render = None
            if self.in_place:
                self.stream.write("\r\x1b[K")
                self.stream.flush()

    def close(self) -> None:
        self.stop.set()
        if self.ticker.is_alive():
            self.ticker.join(2)
        self.clear()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _draw(self) -> None:
        if self.render is None:
            return
        line = self.render(self.elapsed())
        self.stream.write("\r\x1b[K" + line if self.in_place else line + "\n")
        self.stream.flush()

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                self._draw()


def progress_for_stderr(show: bool | None, quiet: bool) -> Progress | None:
    """The progress of a command with --progress/--no-progress (`show`, None: auto) and --quiet:
    None when it is not to be shown (quiet, --no-progress, or stderr not a terminal under auto)."""
    terminal = sys.stderr.isatty()
    if quiet or not (terminal if show is None else show):
        return None
    return Progress(sys.stderr, in_place=terminal)
