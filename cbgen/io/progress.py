"""What one engine's loop has done, counted as it goes: rows, samples, tokens and the step
figures, handed out as snapshots for the display (rates over the last 10 s) and as the run's
figures for the summary; the input's row count found by a thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from cbgen.display import ProgressSnapshot
from cbgen.engine.outputs import RequestOutput, StepStats
from cbgen.io.readers import InputSource
from cbgen.io.shard import RowFilter

_RATE_WINDOW_S = 10.0


class ProgressTracker:
    """Counts what this process did; hands out snapshots for the display and the summary."""

    def __init__(self, max_num_seqs: int, rows_total: int | None = None) -> None:
        self.started = time.perf_counter()
        self.max_num_seqs = max_num_seqs
        self.rows_total = rows_total
        self.rows_done = 0
        self.rows_failed = 0
        self.rows_resumed = 0
        self.rows_generated = 0
        """Rows finished in this run (ok or failed), resumed ones not included."""
        self.samples_written = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.last: StepStats | None = None
        self._marks: deque[tuple[float, int, int, int]] = deque()
        self._lock = threading.Lock()
        self._total_exact = False

    def set_total(self, total: int, exact: bool = True) -> None:
        """An estimate (from the row-counting thread) never replaces an exact count."""
        with self._lock:
            if exact or not self._total_exact:
                self.rows_total = total
                self._total_exact = exact

    def on_step(self, stats: StepStats) -> None:
        self.last = stats
        self.prefill_tokens += stats.num_prefill_tokens
        self.decode_tokens += stats.num_decode_tokens

    def on_sample(self, out: RequestOutput | None) -> None:
        self.samples_written += 1
        if out is not None:
            self.prompt_tokens += out.num_prompt_tokens
            self.cached_tokens += out.num_cached_tokens
            self.completion_tokens += out.num_output_tokens

    def on_record(self, record: Mapping[str, Any]) -> None:
        """An output row another process's engine made (a Ray actor): counted as on_sample."""
        self.samples_written += 1
        if record["finish_reason"] != "error":
            self.prompt_tokens += record["prompt_tokens"] or 0
            self.cached_tokens += record["cached_tokens"] or 0
            self.completion_tokens += record["completion_tokens"] or 0

    def on_row_done(self, failed: bool) -> None:
        self.rows_done += 1
        self.rows_generated += 1
        self.rows_failed += failed

    def on_row_resumed(self) -> None:
        self.rows_done += 1
        self.rows_resumed += 1

    def snapshot(self) -> ProgressSnapshot:
        now = time.perf_counter()
        mark = (now, self.prefill_tokens, self.decode_tokens, self.rows_generated)
        marks = self._marks
        if not marks or now - marks[-1][0] >= 0.5:
            marks.append(mark)
        while len(marks) > 2 and now - marks[1][0] >= _RATE_WINDOW_S:
            marks.popleft()
        t0, p0, d0, r0 = marks[0] if now - marks[0][0] > 0.2 else (self.started, 0, 0, 0)
        span = max(now - t0, 1e-9)
        s = self.last
        with self._lock:
            total = self.rows_total
        return ProgressSnapshot(
            elapsed_s=now - self.started,
            rows_done=self.rows_done,
            rows_total=total,
            rows_failed=self.rows_failed,
            rows_resumed=self.rows_resumed,
            rows_per_s=(self.rows_generated - r0) / span,
            running=s.num_running if s else 0,
            max_num_seqs=self.max_num_seqs,
            waiting=s.num_waiting if s else 0,
            kv_blocks_used=s.num_kv_blocks_used if s else 0,
            kv_blocks_total=s.num_kv_blocks_total if s else 0,
            preemptions=s.total_preemptions if s else 0,
            prefill_tok_s=(self.prefill_tokens - p0) / span,
            decode_tok_s=(self.decode_tokens - d0) / span,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
        )

    def run_stats(self) -> dict[str, Any]:
        """This run's figures for the summary."""
        wall = time.perf_counter() - self.started
        return {
            "rows_generated": self.rows_generated,
            "rows_failed": self.rows_failed,
            "rows_resumed": self.rows_resumed,
            "output_rows_written": self.samples_written,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "loop_s": wall,
        }


def count_rows_in_background(
    source: InputSource, row_filter: RowFilter, tracker: ProgressTracker
) -> None:
    """The display's total: Parquet knows it at once; a JSONL file is counted by a thread."""

    def count() -> None:
        try:
            total, exact = source.estimate_rows()
        except OSError:
            return
        if total is not None:
            tracker.set_total(row_filter.count(total), exact)

    threading.Thread(target=count, name="cbgen-count-rows", daemon=True).start()
