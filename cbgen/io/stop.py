"""Stopping a run cleanly: SIGTERM (Slurm's time limit) or Ctrl-C sets a flag that the loop, the
session and the data-parallel parent read; the exit code then says which signal it was.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType


class StopFlag:
    """Set by SIGTERM (Slurm's time limit) or Ctrl-C: the loop stops feeding and stepping,
    the writer flushes, and the process exits with a resumable state. A second Ctrl-C raises
    KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install(self) -> Callable[[], None]:
        """Handle SIGINT and SIGTERM (main thread only); returns a function that restores the
        previous handlers."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.request(signal.Signals(signum).name)

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)

        return restore

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by that signal."""
        if self.reason in ("SIGTERM", "SIGINT"):
            return 128 + int(signal.Signals[self.reason])
        return 1
