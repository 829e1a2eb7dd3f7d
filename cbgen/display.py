"""What `cbgen run` shows while it runs.

  - a terminal: a Rich live view (progress bar over rows, rate, ETA, slots, waiting queue, KV
    cache use, preemptions, prefill and decode tokens/s, prefix-cache hit rate);
  - not a terminal (cron, Slurm logs): one plain status line every --log-interval seconds;
  - --quiet: nothing until the final summary.

Before the first row, while the engine starts (the CPU kernels built and tuned on first use, the
model loaded), `phase` shows what it is doing: a line a phase in the log, a spinner with the
phase and its seconds on the live view; then `format_startup` says how long each kind took.

Displays only read `ProgressSnapshot`s and the phases' words; they never touch the engine.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TextIO


@dataclass(frozen=True)
class ProgressSnapshot:
    elapsed_s: float
    rows_done: int
    """Input rows finished (every sample written), rows resumed from earlier runs included."""
    rows_total: int | None
    rows_failed: int
    """Rows written as errors in this run."""
    rows_resumed: int
    """Rows skipped because earlier runs wrote them."""
    rows_per_s: float
    """Recent rate of rows generated in this run."""
    running: int
    max_num_seqs: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    prefill_tok_s: float
    decode_tok_s: float
    prompt_tokens: int
    """Prompt tokens of the rows finished in this run."""
    cached_tokens: int
    """... of which served from the prefix cache."""
    completion_tokens: int
    engines: int = 1
    """Engines whose figures these are (data-parallel workers, engines on a Ray cluster)."""

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.rows_total is None or self.rows_per_s <= 0:
            return None
        return max(0, self.rows_total - self.rows_done) / self.rows_per_s

    @classmethod
    def empty(cls, max_num_seqs: int = 0, rows_total: int | None = None) -> ProgressSnapshot:
        values: dict[str, Any] = {f.name: 0 for f in fields(cls)}
        values.update(elapsed_s=0.0, rows_per_s=0.0, prefill_tok_s=0.0, decode_tok_s=0.0, engines=1)
        return cls(**{**values, "max_num_seqs": max_num_seqs, "rows_total": rows_total})

    @classmethod
    def combine(cls, snaps: Sequence[ProgressSnapshot], elapsed_s: float) -> ProgressSnapshot:
        """Several engines (data parallel) as one: counts, slots, rates and engines add up."""
        totals = [s.rows_total for s in snaps]
        summed = {
            f.name: sum(getattr(s, f.name) for s in snaps)
            for f in fields(cls)
            if f.name not in ("elapsed_s", "rows_total")
        }
        return cls(
            elapsed_s=elapsed_s,
            rows_total=None
            if not snaps or None in totals
            else sum(t for t in totals if t is not None),
            **summed,
        )


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rows(snap: ProgressSnapshot) -> str:
    if snap.rows_total:
        return (
            f"rows {snap.rows_done}/{snap.rows_total} {100 * snap.rows_done / snap.rows_total:.1f}%"
        )
    return f"rows {snap.rows_done}"


def format_startup(startup_s: dict[str, float]) -> str:
    """'start-up 48.2s: build 20.1s, tune 25.3s, load 2.1s' from the summary's startup_s
    (cbgen.phases.StartupTimes.as_dict): the kinds that took half a second or more."""
    parts = [
        f"{kind} {_seconds(s)}"
        for kind, s in startup_s.items()
        if kind not in ("total", "other") and s >= 0.5
    ]
    total = f"start-up {_seconds(startup_s.get('total', 0.0))}"
    return f"{total}: {', '.join(parts)}" if parts else total


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else format_duration(s)


def format_status(snap: ProgressSnapshot) -> str:
    """One line for logs, e.g.
    [cbgen 1m05s] rows 1200/10000 12.0% (3 failed, 0 resumed) 45.2 rows/s ETA 3m14s | slots 60/64
    waiting 128 | kv 71.3% | preemptions 4 | prefill 1520 tok/s decode 900 tok/s | cache hit 12.5%"""
    return (
        f"[cbgen {format_duration(snap.elapsed_s)}] {format_rows(snap)} "
        f"({snap.rows_failed} failed, {snap.rows_resumed} resumed) {snap.rows_per_s:.1f} rows/s "
        f"ETA {format_duration(snap.eta_s)} | slots {snap.running}/{snap.max_num_seqs} "
        f"waiting {snap.waiting} | kv {100 * snap.kv_usage:.1f}% | preemptions {snap.preemptions} | "
        f"prefill {snap.prefill_tok_s:.0f} tok/s decode {snap.decode_tok_s:.0f} tok/s | "
        f"cache hit {100 * snap.cache_hit_rate:.1f}%{_engines(snap, ' | ')}"
    )


def _engines(snap: ProgressSnapshot, before: str = "") -> str:
    """'engines N' where a run has other than one (several workers, a Ray cluster)."""
    return f"{before}engines {snap.engines}" if snap.engines != 1 else ""


class Display:
    """Quiet: shows nothing. Subclasses show progress; `message` always reaches the user."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def start(self) -> None:
        pass

    def phase(self, kind: str, text: str, seconds: float | None) -> None:
        """A start-up phase begins (seconds None) or ends (a cbgen.phases listener)."""

    def update(self, snap: ProgressSnapshot) -> None:
        """Called often (every engine step); implementations rate-limit themselves."""

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def stop(self, snap: ProgressSnapshot | None = None) -> None:
        pass


class LogDisplay(Display):
    """A status line every `interval` seconds, and one more at the end."""

    def __init__(self, interval: float, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.interval = interval
        self._next = time.monotonic() + interval

    def phase(self, kind: str, text: str, seconds: float | None) -> None:
        if seconds is None:  # how long it took: the summary says
            print(f"[cbgen] {text}", file=self.stream, flush=True)

    def update(self, snap: ProgressSnapshot) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            print(format_status(snap), file=self.stream, flush=True)

    def stop(self, snap: ProgressSnapshot | None = None) -> None:
        if snap is not None:
            print(format_status(snap), file=self.stream, flush=True)


class LiveDisplay(Display):
    """Rich live view, redrawn at most four times a second. Before start, a phase shows as a
    spinner line that counts its seconds (redrawn by Rich's thread: the phase's work holds the
    main thread), cleared when the view starts."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        from rich.console import Console

        self.console = Console(file=self.stream)
        self._live: Any = None
        self._last = 0.0
        self._phase: _PhaseLine | None = None
        self._phase_live: Any = None

    def phase(self, kind: str, text: str, seconds: float | None) -> None:
        if self._live is not None:
            return
        if self._phase is None:
            from rich.live import Live

            self._phase = _PhaseLine()
            self._phase_live = Live(
                self._phase, console=self.console, refresh_per_second=4, transient=True
            )
            self._phase_live.start()
        if seconds is None:
            self._phase.begin(text)
        else:
            self._phase.end(text)
        self._phase_live.refresh()

    def _stop_phase(self) -> None:
        if self._phase_live is not None:
            self._phase_live.stop()
            self._phase_live = self._phase = None

    def start(self) -> None:
        from rich.live import Live

        self._stop_phase()
        self._live = Live(
            self._render(ProgressSnapshot.empty()), console=self.console, auto_refresh=False
        )
        self._live.start()

    def update(self, snap: ProgressSnapshot) -> None:
        now = time.monotonic()
        if self._live is not None and now - self._last >= 0.25:
            self._last = now
            self._live.update(self._render(snap), refresh=True)

    def message(self, text: str) -> None:
        live = self._live or self._phase_live
        if live is not None:
            live.console.print(text, markup=False, highlight=False)
        else:
            super().message(text)

    def stop(self, snap: ProgressSnapshot | None = None) -> None:
        self._stop_phase()
        if self._live is not None:
            if snap is not None:
                self._live.update(self._render(snap), refresh=True)
            self._live.stop()
            self._live = None

    @staticmethod
    def _render(snap: ProgressSnapshot) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        # Short cells, so the view fits an 80-column terminal.
        head = Table.grid(padding=(0, 2))
        head.add_row(
            ProgressBar(total=snap.rows_total, completed=snap.rows_done, width=24),
            format_rows(snap),
            f"{snap.rows_per_s:.1f} rows/s",
            f"ETA {format_duration(snap.eta_s)}",
        )
        stats = Table.grid(padding=(0, 3))
        stats.add_row(
            f"slots [bold]{snap.running}[/]/{snap.max_num_seqs}",
            f"waiting [bold]{snap.waiting}[/]",
            f"KV cache [bold]{100 * snap.kv_usage:.1f}%[/]",
            f"preemptions [bold]{snap.preemptions}[/]",
        )
        stats.add_row(
            f"prefill [bold]{snap.prefill_tok_s:.0f}[/] tok/s",
            f"decode [bold]{snap.decode_tok_s:.0f}[/] tok/s",
            f"cache hit [bold]{100 * snap.cache_hit_rate:.1f}%[/]",
            f"failed [bold]{snap.rows_failed}[/]",
        )
        stats.add_row(
            f"elapsed {format_duration(snap.elapsed_s)}",
            f"resumed {snap.rows_resumed}",
            _engines(snap),
            "",
        )
        return Group(head, stats)


class _PhaseLine:
    """The live view's line while the engine starts: a spinner, the innermost phase running
    and its seconds (between phases, 'starting' and the seconds since the first began)."""

    def __init__(self) -> None:
        from rich.spinner import Spinner

        self.spinner = Spinner("dots")
        self.started = time.monotonic()
        self.running: list[tuple[str, float]] = []

    def begin(self, text: str) -> None:
        self.running.append((text, time.monotonic()))

    def end(self, text: str) -> None:
        """The last phase begun with this text (data-parallel workers' phases interleave)."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i][0] == text:
                del self.running[i]
                return

    def __rich__(self) -> Any:
        from rich.text import Text

        top = self.running[-1:]  # one read: the main thread pushes and pops meanwhile
        text, since = top[0] if top else ("starting", self.started)
        self.spinner.update(text=Text(f"{text}  {format_duration(time.monotonic() - since)}"))
        return self.spinner


def make_display(quiet: bool, log_interval: float, stream: TextIO | None = None) -> Display:
    """Live view on a terminal, log lines elsewhere, nothing under --quiet."""
    stream = stream or sys.stdout
    if quiet:
        return Display(stream)
    if stream.isatty():
        return LiveDisplay(stream)
    return LogDisplay(log_interval, stream)
