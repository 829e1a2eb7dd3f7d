"""One engine kept full from a queue: what every Ray actor of cbgen runs (the engines of
`cbgen run --ray` and those of the Ray Data processor). It imports no Ray.

    submit(rows) ──▶ inbox ──▶ GenerationLoop, in its own thread (parse errors, resume keys,
                                tokenize, seeds, add_request x n, step, records)
                                  │ each output row ──▶ on_record(row, record)
                                  │ each row finished ──▶ on_row_done(row, outcome)
                                  └ progress ──▶ snapshot()

Rows arrive while the engine runs and join it at the next step, so a slot that frees is
refilled at once: nothing waits for a batch or a block of rows to drain. The loop is the
local run's own (cbgen.io.pipeline), so a row gives the same output row here as there.

The engine is built in the thread that runs it, and no other thread of the process runs its
kernels: OpenMP (libgomp) keeps a team of worker threads for each thread that ran a parallel
region, and once a process holds more of them than it has CPUs, a worker sleeps right after
each region instead of spinning, so each of a step's hundreds of regions waits for a wake-up.
Built in the caller's thread (the actor's main one), the engine ran 5-11 % slower under Ray.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from cbgen.config import EngineConfig
from cbgen.display import Display, ProgressSnapshot
from cbgen.engine.engine import Engine
from cbgen.io.pipeline import END, GenerationLoop
from cbgen.io.progress import ProgressTracker
from cbgen.io.rows import ChatDefaults, InputRow
from cbgen.io.stop import StopFlag
from cbgen.sampling_params import SamplingParams

Outcome = Literal["ok", "failed", "resumed"]
"""How a row ended: its samples written, one of them (or the row) an error, or all of them
written before (the keys handed in with the row)."""

RecordHandler = Callable[[InputRow, dict[str, Any]], None]
RowHandler = Callable[[InputRow, Outcome], None]


class _NoSink:
    """The loop's writer when its rows go to on_record instead."""

    def __init__(self) -> None:
        self.buffer: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        raise AssertionError("rows go to on_record")

    def flush(self) -> None:
        pass


class _WorkerLoop(GenerationLoop):
    """The local loop, its rows handed to the worker's callbacks instead of a file."""

    def __init__(self, worker: EngineWorker, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.worker = worker

    def _write(self, row: InputRow, record: dict[str, Any]) -> None:
        self.worker.on_record(row, record)

    def _row_done(self, row: InputRow, failed: bool) -> None:
        super()._row_done(row, failed)
        self.worker.on_row_done(row, "failed" if failed else "ok")

    def _row_resumed(self, row: InputRow) -> None:
        super()._row_resumed(row)
        self.worker.on_row_done(row, "resumed")


class EngineWorker:
    """An engine and its loop thread. `submit` may be called from any thread; the callbacks
    run in the loop's thread, a row's records always before its on_row_done."""

    def __init__(
        self,
        config: EngineConfig,
        defaults: SamplingParams,
        on_record: RecordHandler,
        on_row_done: RowHandler,
        chat: ChatDefaults | None = None,
    ) -> None:
        self.on_record = on_record
        self.on_row_done = on_row_done
        self.stop = StopFlag()
        self.error: BaseException | None = None
        """What ended the loop thread, when it was not close()."""
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._done: set[bytes] = set()
        self.tracker = ProgressTracker(config.max_num_seqs)
        self._snapshot = self.tracker.snapshot()
        self._built = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(config, defaults, chat), name="cbgen-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self.error is not None:  # the engine could not be built: the caller's to report
            raise self.error

    def _build(
        self, config: EngineConfig, defaults: SamplingParams, chat: ChatDefaults | None
    ) -> None:
        self.engine = Engine(config)
        self.loop = _WorkerLoop(
            self,
            engine=self.engine,
            rows=self._rows(),
            writer=_NoSink(),
            tracker=self.tracker,
            display=Display(),
            defaults=defaults,
            done=self._done,
            stop=self.stop,
            on_progress=self._progress,
            input_may_block=True,
            chat=chat,
        )

    def describe(self) -> str:
        return self.engine.describe()

    def submit(self, rows: Iterable[tuple[InputRow, Iterable[bytes]]]) -> None:
        """Queue rows, each with the keys of its samples already written (a resume); they
        join the engine as its slots free."""
        for row, done in rows:
            self._done.update(done)  # before the row is queued: the loop reads it after
            self._inbox.put(row)

    def snapshot(self) -> ProgressSnapshot:
        """The engine's figures (slots, queue, KV cache, rates), at most 0.1 s old."""
        return self._snapshot

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the loop: rows in flight are dropped."""
        self.stop.request("closed")
        self._inbox.put(END)
        self._thread.join(30)

    def _rows(self) -> Iterator[InputRow]:
        while (row := self._inbox.get()) is not END:
            yield row

    def _progress(self, snap: ProgressSnapshot) -> None:
        self._snapshot = snap

    def _run(
        self, config: EngineConfig, defaults: SamplingParams, chat: ChatDefaults | None
    ) -> None:
        try:
            self._build(config, defaults, chat)
        except BaseException as e:  # raised by __init__
            self.error = e
        self._built.set()
        if self.error is not None:
            return
        try:
            self.loop.run()
        except BaseException as e:  # reported by the caller, which reads .error
            self.error = e
