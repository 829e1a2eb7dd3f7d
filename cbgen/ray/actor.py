"""The engine actor of `cbgen run --ray`: an EngineWorker behind two calls, made into a Ray actor
by the driver (cbgen.ray.driver); plain Python, so it is tested without a cluster too.

    driver ── ready() ───────────────────────────▶ (description, start-up phases, pid, host)
           ── exchange(rows) ─ queued; returns ──▶ Reply: the output rows made since the last
              when rows have finished (after 20 ms     reply, the rows finished (row index, how)
              at least), or after 0.5 s anyway         and the engine's figures

One exchange is in flight per actor: it carries the rows that top the actor up and brings back
what finished, so the driver needs no other call while the engine runs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cbgen.config import EngineConfig
from cbgen.display import ProgressSnapshot
from cbgen.io.rows import ChatDefaults, InputRow
from cbgen.phases import StartupTimes, listening
from cbgen.ray.worker import EngineWorker, Outcome
from cbgen.sampling_params import SamplingParams

MIN_WAIT_S = 0.02
"""An exchange returns no sooner: rows finishing one by one travel a few at a time."""
MAX_WAIT_S = 0.5
"""... and no later, with nothing finished: the driver's display stays current."""


@dataclass(frozen=True)
class EngineInfo:
    describe: str
    load_s: float
    startup_s: dict[str, float]
    """The engine's start-up by kind of phase (StartupTimes.as_dict), for the summary."""
    pid: int
    host: str


@dataclass
class Reply:
    records: list[dict[str, Any]] = field(default_factory=list)
    """Output rows, a row's always before it is in `finished`."""
    finished: list[tuple[int, Outcome]] = field(default_factory=list)
    """(row index, how it ended) of every row done."""
    snapshot: ProgressSnapshot | None = None


class EngineActor:
    """An engine fed by exchange(); run as a Ray actor with max_concurrency > 1, so that an
    exchange waiting for results never blocks ready() after a restart."""

    def __init__(
        self, config: EngineConfig, defaults: SamplingParams, chat: ChatDefaults | None = None
    ) -> None:
        self._cond = threading.Condition()
        self._reply = Reply()
        times = StartupTimes()
        with listening(times.record):  # the kernel build and tuning run on each new node
            self.worker = EngineWorker(config, defaults, self._on_record, self._on_row_done, chat)
        self._startup = times.as_dict(self.worker.engine.init_time_s)

    def ready(self) -> EngineInfo:
        return EngineInfo(
            self.worker.describe(),
            self.worker.engine.init_time_s,
            self._startup,
            os.getpid(),
            socket.gethostname(),
        )

    def exchange(self, rows: list[tuple[InputRow, tuple[bytes, ...]]]) -> Reply:
        """Queue `rows` (each with the keys of its samples already written) and hand back
        what finished; raises what ended the engine's loop, if it ended."""
        self.worker.submit(rows)
        start = time.monotonic()
        with self._cond:
            while True:
                if self.worker.error is not None:
                    raise RuntimeError(f"the engine failed: {self.worker.error!r}")
                waited = time.monotonic() - start
                has = self._reply.records or self._reply.finished
                if (has and waited >= MIN_WAIT_S) or waited >= MAX_WAIT_S:
                    break
                self._cond.wait(max(MIN_WAIT_S - waited if has else MAX_WAIT_S - waited, 0.001))
            reply, self._reply = self._reply, Reply()
        reply.snapshot = self.worker.snapshot()
        return reply

    def close(self) -> None:
        self.worker.close()

    def _on_record(self, row: InputRow, record: dict[str, Any]) -> None:
        with self._cond:
            self._reply.records.append(record)

    def _on_row_done(self, row: InputRow, outcome: Outcome) -> None:
        with self._cond:
            self._reply.finished.append((row.row, outcome))
            self._cond.notify_all()
