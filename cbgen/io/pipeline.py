"""The run loop of one engine: read rows, feed the engine as slots free up, write what finishes.

    rows ──▶ top up: while the engine holds < queue_depth requests, take the next row:
    (stream)   error / already done / tokenize / validate / add_request x n samples
                 │ bad row ─────────────────────────────────────────────▶ writer (error row)
                 ▼
             engine.step() ──finished──▶ writer.add (flushed every 0.1 s) ──▶ staging stream
                 │ stats ──▶ tracker ──▶ display

The engine never holds more than queue_depth requests (plus the samples of one row), so
memory does not depend on the input size; finished rows reach the OS within FLUSH_INTERVAL_S,
so a killed process loses the requests in flight and at most 0.1 s of finished rows.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cbgen.display import Display, ProgressSnapshot
from cbgen.engine.outputs import RequestOutput
from cbgen.io.parse import make_params
from cbgen.io.progress import ProgressTracker
from cbgen.io.rows import ChatDefaults, InputRow, RowError
from cbgen.io.schema import error_record, ok_record
from cbgen.io.stop import StopFlag
from cbgen.io.writer import row_key
from cbgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbgen.engine.engine import Engine

FLUSH_INTERVAL_S = 0.1
"""Finished rows reach the OS at the first step end at least this long after the previous
flush: a killed process loses the requests in flight and at most this much of finished work,
while staging streams do not pay one record batch (about 1 KiB of metadata) per step."""


def sample_seed(params: SamplingParams, base_seed: int, row: int, sample_index: int) -> int | None:
    """The seed of one sample. A row's own seed gives seed + sample_index; otherwise a seed is
    derived from (engine seed, row, sample) so results do not depend on sharding, workers or
    resuming. Greedy rows need none."""
    if params.seed is not None:
        return params.seed + sample_index
    if params.greedy:
        return None
    digest = hashlib.blake2b(f"{base_seed}:{row}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RowSink(Protocol):
    """Where the loop's output rows go: a StagingWriter, or what a Ray actor hands back."""

    buffer: list[dict[str, Any]]
    """Rows added and not yet flushed."""

    def add(self, record: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


class DoneKeys(Protocol):
    """The row_key of every output row already written (a KeySet, or a set of them)."""

    def __contains__(self, key: bytes, /) -> bool: ...


END = object()
"""RowFeed.get: the input has no more rows."""


@dataclass(frozen=True)
class _ReadFailed:
    """RowFeed's read-ahead thread hit an error: the loop raises it (a cut input must not
    look like a finished one)."""

    error: BaseException


class RowFeed:
    """The loop's view of the input. A file is read in the loop's own thread, one row at a
    time. Input that may block (stdin, a URL) is read ahead by a thread into a bounded queue,
    so the loop never waits on the input while the engine has work, and memory stays bounded;
    an error of that thread reaches the loop as the exception it was."""

    def __init__(self, rows: Iterator[InputRow], may_block: bool, read_ahead: int = 1024) -> None:
        self.rows = rows
        self.queue: queue.Queue[Any] | None = None
        if may_block:
            self.queue = queue.Queue(maxsize=read_ahead)
            threading.Thread(target=self._pump, name="cbgen-read-input", daemon=True).start()

    def _pump(self) -> None:
        assert self.queue is not None
        try:
            for row in self.rows:
                self.queue.put(row)
        except BaseException as e:
            self.queue.put(_ReadFailed(e))
            return
        self.queue.put(END)

    def get(self, wait: bool) -> Any:
        """The next row, END, or None when no row is ready (waits up to 0.1 s if `wait`)."""
        if self.queue is None:
            return next(self.rows, END)
        try:
            item = self.queue.get(timeout=0.1) if wait else self.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, _ReadFailed):
            raise item.error
        return item


@dataclass
class _RowGroup:
    """The samples of one input row still in flight."""

    remaining: int
    failed: bool = False


@dataclass(frozen=True)
class _Flight:
    row: InputRow
    sample_index: int
    group: _RowGroup


class GenerationLoop:
    def __init__(
        self,
        engine: Engine,
        rows: Iterator[InputRow],
        writer: RowSink,
        tracker: ProgressTracker,
        display: Display,
        defaults: SamplingParams,
        done: DoneKeys,
        stop: StopFlag,
        queue_depth: int | None = None,
        on_progress: Callable[[ProgressSnapshot], None] | None = None,
        input_may_block: bool = False,
        chat: ChatDefaults | None = None,
    ) -> None:
        """input_may_block: reading the next row may wait for a writer (stdin): rows are read
        ahead by a thread, and finished rows are flushed whenever the engine runs dry."""
        self.engine = engine
        self.rows = rows
        self.writer = writer
        self.tracker = tracker
        self.display = display
        self.defaults = defaults
        self.chat = chat or ChatDefaults()
        self.reasoning_tags = engine.reasoning_tags()
        self.done = done
        self.stop = stop
        # Enough waiting requests to refill every slot that frees in a step, no more.
        self.queue_depth = queue_depth or 2 * engine.config.max_num_seqs
        self.on_progress = on_progress
        self.input_may_block = input_may_block
        self.feed = RowFeed(rows, input_may_block)
        self.inflight: dict[str, _Flight] = {}
        self.exhausted = False
        self.rows_seen = 0
        """Rows taken from the input; also numbers the engine's request ids, which stay unique
        when rows from several sources share row indices (a Ray Data processor's batches)."""
        self._last_report = 0.0
        self._last_flush = 0.0
        self._params_cache: dict[Any, SamplingParams | str] = {}

    def run(self) -> bool:
        """Until the input is exhausted and every request finished (True), or a stop was
        requested (False; in-flight requests are dropped, to be redone by a rerun)."""
        while not self.stop.requested:
            self._top_up()
            if not self.engine.has_unfinished_requests():
                if self.exhausted:
                    break
                continue
            out = self.engine.step()
            self.tracker.on_step(out.stats)
            for result in out.finished:
                self._finish(result)
            now = time.monotonic()
            if now - self._last_flush >= FLUSH_INTERVAL_S:
                self._last_flush = now
                self.writer.flush()
            self._report()
        self.writer.flush()
        self._report(force=True)
        return self.exhausted and not self.inflight

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < 0.1:
            return
        self._last_report = now
        snap = self.tracker.snapshot()
        self.display.update(snap)
        if self.on_progress is not None:
            self.on_progress(snap)

    # ---- feeding -------------------------------------------------------------------------
    def _top_up(self) -> None:
        engine = self.engine
        while not self.exhausted and engine.num_unfinished_requests < self.queue_depth:
            if self.stop.requested:
                return
            idle = not engine.has_unfinished_requests()
            if idle and self.input_may_block and self.writer.buffer:
                self.writer.flush()
                self._report(force=True)
            row = self.feed.get(wait=idle)
            if row is END:
                self.exhausted = True
                self.tracker.set_total(self.rows_seen)
                return
            if row is None:  # the input has nothing ready
                if not idle:
                    return  # step the engine meanwhile
                self._report()
                continue
            self.rows_seen += 1
            self._submit(row)
            if self.rows_seen % 1024 == 0:
                self.writer.flush()
                self._report()

    def _submit(self, row: InputRow) -> None:
        if row.error is not None:
            self._fail_row(row, row.error)
            return
        params = self._params(row.overrides)
        if isinstance(params, str):
            self._fail_row(row, f"{row.where}: {params}")
            return
        pending = [i for i in range(params.n) if row_key(row.id, i) not in self.done]
        if not pending:
            self._row_resumed(row)
            return
        try:
            token_ids = self._tokens(row)
        except RowError as e:
            self._fail_row(row, f"{row.where}: {e}")
            return
        try:
            self.engine.validate_request(token_ids, params)
        except ValueError as e:
            self._fail_row(row, f"{row.where}: {e}", len(token_ids))
            return
        group = _RowGroup(len(pending))
        base_seed = self.engine.config.seed
        for i in pending:
            rid = f"{self.rows_seen}:{i}"
            sample_params = params.replace(n=1, seed=sample_seed(params, base_seed, row.row, i))
            try:
                self.engine.add_request(rid, token_ids, sample_params)
            except ValueError as e:
                self._write(row, error_record(row, f"{row.where}: {e}", len(token_ids), i))
                self.tracker.on_sample(None)
                group.failed = True
                group.remaining -= 1
                continue
            self.inflight[rid] = _Flight(row, i, group)
        if group.remaining == 0:
            self._row_done(row, failed=True)

    def _params(self, overrides: dict[str, Any]) -> SamplingParams | str:
        """The row's SamplingParams, or the reason they are invalid. Rows mostly repeat the
        same few overrides, so results are cached by value (the cache is small and bounded)."""
        try:
            # types are part of the key: 1, 1.0 and True are equal in Python, not as fields
            key: Any = tuple(sorted((k, type(v).__name__, v) for k, v in overrides.items()))
            hash(key)
        except TypeError:  # unhashable values, e.g. a stop list
            key = json.dumps(overrides, sort_keys=True, default=repr)
        hit = self._params_cache.get(key)
        if hit is None:
            try:
                hit = make_params(self.defaults, overrides)
            except RowError as e:
                hit = str(e)
            if len(self._params_cache) >= 1024:
                self._params_cache.clear()
            self._params_cache[key] = hit
        return hit

    def _tokens(self, row: InputRow) -> list[int]:
        try:
            if row.messages is not None:
                return self.engine.apply_chat_template(
                    row.messages, **self.chat.render_options(row.chat)
                )
            if isinstance(row.prompt, str):
                return self.engine.tokenize(row.prompt)
        except Exception as e:  # a chat template may raise anything (jinja errors included)
            what = "messages" if row.messages is not None else "prompt"
            raise RowError(f"{what}: could not be tokenized: {e}") from None
        assert row.prompt is not None  # parse_mapping guarantees a prompt or messages
        return list(row.prompt)

    def _fail_row(self, row: InputRow, message: str, prompt_tokens: int | None = None) -> None:
        """A whole row failed before reaching the engine: one error row (sample 0), unless an
        earlier run already wrote it."""
        if row_key(row.id, 0) in self.done:
            self._row_resumed(row)
            return
        self._write(row, error_record(row, message, prompt_tokens))
        self.tracker.on_sample(None)
        self._row_done(row, failed=True)

    # ---- where rows end: a subclass may send them elsewhere (cbgen.ray.worker) ---------------
    def _write(self, row: InputRow, record: dict[str, Any]) -> None:
        """One output row (a sample of `row`) is final."""
        self.writer.add(record)

    def _row_done(self, row: InputRow, failed: bool) -> None:
        """Every sample of `row` is written."""
        self.tracker.on_row_done(failed=failed)

    def _row_resumed(self, row: InputRow) -> None:
        """`row` was written by an earlier run."""
        self.tracker.on_row_resumed()

    # ---- results -------------------------------------------------------------------------
    def _finish(self, out: RequestOutput) -> None:
        flight = self.inflight.pop(out.request_id)
        if out.finish_reason in ("stop", "length"):
            self._write(
                flight.row, ok_record(flight.row, flight.sample_index, out, self.reasoning_tags)
            )
            self.tracker.on_sample(out)
        else:
            message = out.error or f"the engine ended the request with {out.finish_reason!r}"
            self._write(
                flight.row,
                error_record(
                    flight.row,
                    f"{flight.row.where}: {message}",
                    out.num_prompt_tokens,
                    flight.sample_index,
                ),
            )
            self.tracker.on_sample(None)
            flight.group.failed = True
        flight.group.remaining -= 1
        if flight.group.remaining == 0:
            self._row_done(flight.row, failed=flight.group.failed)
