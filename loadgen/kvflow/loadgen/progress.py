"""The progress line of a long run: counts the runner updates, printed by a small task.

On a terminal the line is redrawn in place every second; into a file or a CI log it is a
new line every 10 s, so a 10-minute ladder leaves 60 lines, not 600.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TextIO

TTY_INTERVAL_S = 1.0
LOG_INTERVAL_S = 10.0


class Progress:
    def __init__(
        self, label: str, planned_s: float, num_planned: int | None, out: TextIO | None
    ) -> None:
        self.label = label
        self.planned_s = planned_s
        self.num_planned = num_planned
        self.out = out
        self.num_sent = 0
        self.num_done = 0
        self.num_errors = 0
        self._is_tty = bool(out is not None and out.isatty())

    def line(self, elapsed_s: float) -> str:
        planned = f"/{self.num_planned}" if self.num_planned is not None else ""
        return (
            f"[{self.label}] {elapsed_s:6.1f}/{self.planned_s:.0f} s  "
            f"sent {self.num_sent}{planned}  done {self.num_done}  "
            f"in flight {self.num_sent - self.num_done}  errors {self.num_errors}"
        )

    def _show(self, elapsed_s: float) -> None:
        assert self.out is not None
        if self._is_tty:
            self.out.write("\r\033[K" + self.line(elapsed_s))
        else:
            self.out.write(self.line(elapsed_s) + "\n")
        self.out.flush()

    async def show_every_interval(self, now: Callable[[], float]) -> None:
        """Runs until cancelled."""
        if self.out is None:
            return
        interval_s = TTY_INTERVAL_S if self._is_tty else LOG_INTERVAL_S
        while True:
            await asyncio.sleep(interval_s)
            self._show(now())

    def finish(self, elapsed_s: float) -> None:
        if self.out is None:
            return
        self._show(elapsed_s)
        if self._is_tty:
            self.out.write("\n")
            self.out.flush()
