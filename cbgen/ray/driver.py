"""`cbgen run --ray`: this process reads the input and writes the output, as a local run does;
engines on the cluster, one Ray actor each, make the rows.

    input ─ cbgen's reader (any source it opens) ─ skip rows written before ─┐
                                                                           ▼
    retry queue (rows of a lost engine) ─▶ top each engine up to 3 x max_num_seqs rows
                                            │ exchange(rows) ──▶ actor k: EngineWorker
                                            ◀──── records, rows finished, engine figures
    staging sink ◀─ each (row, sample) once ◀┘           display ◀─ figures summed

Only this process touches the input and the output, through the same reader, staging writer,
lock and resume keys as a local run: an engine needs the model, nothing else. Rows are fed as
engines' slots free, not in blocks, so no engine waits for a batch to drain.

A lost engine (its process or node died): the rows it held go back to the front of the queue
for any engine, with the samples already received marked done, so nothing is made twice in
the output and nothing is lost; Ray restarts the actor (up to MAX_RESTARTS times). Every engine
lost for good: FatalError, the rows written so far kept for a rerun, as when this process dies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cbgen.display import Display, ProgressSnapshot
from cbgen.io.part import PartResult, RunPlan
from cbgen.io.pipeline import END, FLUSH_INTERVAL_S, RowFeed
from cbgen.io.progress import ProgressTracker, count_rows_in_background
from cbgen.io.readers import open_source
from cbgen.io.rows import InputRow
from cbgen.io.schema import output_schema
from cbgen.io.session import FatalError
from cbgen.io.stop import StopFlag
from cbgen.io.writer import KeySet, row_key, staging_tag
from cbgen.ray.actor import EngineActor, EngineInfo, Reply
from cbgen.ray.cluster import (
    Placement,
    RayError,
    RayOptions,
    connect,
    disconnect,
    import_ray,
    place_engines,
)

MAX_RESTARTS = 3
"""Times Ray restarts a lost engine actor before the run goes on without it."""
ROWS_PER_SLOT = 3
"""Rows an engine holds per slot: 2 x max_num_seqs queued in the engine (the local loop's
depth) and as many again in its inbox, so it never waits on a round trip to the driver."""
START_GRACE_S = 30.0
"""For this long after the first engine is ready, engines still loading their model count in
each engine's share of the rows left (_share), so that a small input spreads over the cluster
instead of filling the first engine ready; one that comes later (no room yet, an autoscaler)
takes what is left then."""


def generate_on_ray(
    options: RayOptions, plan: RunPlan, display: Display, stop: StopFlag
) -> PartResult:
    """session.Generate for --ray: connect, place the engines, feed them, leave the cluster."""
    try:
        connect(options.address)
    except RayError as e:
        raise FatalError(str(e)) from None
    try:
        ray = import_ray()
        try:
            placement = place_engines(options, plan.engine_config, ray.nodes())
        except RayError as e:
            raise FatalError(str(e)) from None
        return _Driver(plan, placement, display, stop).run()
    finally:
        disconnect()


@dataclass
class _Sent:
    """A row an engine holds."""

    row: InputRow
    done: tuple[bytes, ...]
    """Keys of its samples written before it was sent (a resume)."""
    received: set[int] = field(default_factory=set)
    """Samples whose output rows arrived."""

    def keys_done(self) -> tuple[bytes, ...]:
        return self.done + tuple(row_key(self.row.id, i) for i in sorted(self.received))


@dataclass
class _Engine:
    index: int
    handle: Any
    call: Any = None
    """The call in flight (ready or exchange), None once the engine is lost for good."""
    info: EngineInfo | None = None
    """Set while the engine is ready (between its start and a loss)."""
    held: dict[int, _Sent] = field(default_factory=dict)
    """Rows sent and not finished, by row index."""
    snap: ProgressSnapshot | None = None
    losses: int = 0
    rows_made: int = 0
    """Rows it finished (ok or failed) in this run, over its restarts."""

    def name(self) -> str:
        where = f" (pid {self.info.pid} on {self.info.host})" if self.info else ""
        return f"engine {self.index}{where}"


class _Driver:
    def __init__(
        self, plan: RunPlan, placement: Placement, display: Display, stop: StopFlag
    ) -> None:
        self.ray = import_ray()
        self.plan = plan
        self.placement = placement
        self.display = display
        self.stop = stop
        self.depth = ROWS_PER_SLOT * plan.engine_config.max_num_seqs
        # the input, the resume keys and the staging sink as a local run's engine has them
        self.source = source = open_source(plan.input_path, plan.columns, plan.storage)
        self.done: KeySet = plan.layout.done_keys()
        self.tracker = ProgressTracker(0)
        """Counts rows and tokens; its clock (the summary's loop_s and rates) restarts when the
        first engine is ready, as a local run's starts when its engine has loaded. The input's
        rows are counted meanwhile, for the display and for _share."""
        count_rows_in_background(source, plan.row_filter, self.tracker)
        self.first_ready = math.inf
        self.writer = plan.layout.staging_writer(output_schema(source.keep_types), staging_tag())
        self.feed = RowFeed(source.rows(plan.row_filter), source.may_block)
        self.exhausted = False
        self.rows_seen = 0
        self.retry: deque[_Sent] = deque()
        self.engines: list[_Engine] = []
        self.describe = ""
        self.load_s = 0.0
        self.startup_s: dict[str, float] = {}
        """The slowest engine's start-up, each kind of phase apart (as merge_stats has it)."""
        self.last_error = ""

    # ---- the run ---------------------------------------------------------------------------
    def run(self) -> PartResult:
        p = self.placement
        actor = self.ray.remote(EngineActor).options(
            num_cpus=p.num_cpus,
            num_gpus=p.num_gpus,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,  # a lost exchange is redone by the driver, row by row
            max_concurrency=4,
            scheduling_strategy="SPREAD",
        )
        for k in range(p.engines):
            handle = actor.remote(p.config, self.plan.defaults, self.plan.chat)
            self.engines.append(_Engine(k, handle, handle.ready.remote()))
        self.display.message(f"Ray: {p.describe()}; loading the model on each")
        if self.done:
            self.display.message(f"{len(self.done)} output rows already written; skipping them")
        started = False
        last_flush = 0.0
        try:
            while not self.stop.requested and not self._finished():
                calls = {e.call: e for e in self.engines if e.call is not None}
                if not calls:
                    raise FatalError(
                        f"every engine on the Ray cluster was lost (last: {self.last_error}); "
                        f"{self._kept()}"
                    )
                ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=0.1)
                if ready:
                    ready, _ = self.ray.wait(list(calls), num_returns=len(calls), timeout=0)
                for ref in ready:
                    self._answer(calls[ref], ref)
                if not started and self.describe:
                    started = True
                    self.display.start()
                now = time.monotonic()
                if now - last_flush >= FLUSH_INTERVAL_S:
                    last_flush = now
                    self.writer.flush()
                if started:
                    self.display.update(self.snapshot())
        finally:
            self.writer.close()
            for e in self.engines:
                self.ray.kill(e.handle, no_restart=True)
            if started:
                self.display.stop(self.snapshot())
                made = ", ".join(str(e.rows_made) for e in self.engines)
                self.display.message(f"rows made by each engine: {made}")
        stats = self.tracker.run_stats()
        stats["load_s"] = self.load_s
        if self.startup_s:
            stats["startup_s"] = self.startup_s
        return PartResult(self._finished(), stats, self.describe, self.snapshot())

    def _finished(self) -> bool:
        return self.exhausted and not self.retry and not any(e.held for e in self.engines)

    def _kept(self) -> str:
        if self.writer.rows_written or self.writer.buffer:
            return (
                f"the rows finished so far are saved in {self.plan.layout.staging}. Rerun the "
                "same command to resume."
            )
        return "no rows were written."

    # ---- one answer of an engine -----------------------------------------------------------
    def _answer(self, e: _Engine, ref: Any) -> None:
        exceptions = self.ray.exceptions
        try:
            value = self.ray.get(ref)
        except exceptions.RayActorError as err:
            self._lost(e, err, dead=getattr(err, "actor_init_failed", False))
            return
        except exceptions.RayError as err:  # the engine's loop raised: it is not fit to go on
            self._lost(e, err, dead=True)
            return
        if isinstance(value, EngineInfo):
            self._ready(e, value)
        else:
            self._take(e, value)
        e.call = e.handle.exchange.remote(self._rows_for(e))

    def _ready(self, e: _Engine, info: EngineInfo) -> None:
        e.info = info
        self.load_s = max(self.load_s, info.load_s)
        for kind, seconds in info.startup_s.items():
            self.startup_s[kind] = max(self.startup_s.get(kind, 0.0), seconds)
        if not self.describe:
            self.describe = info.describe
            self.display.message(info.describe)
            self.tracker.started = time.perf_counter()
            self.first_ready = time.monotonic()
        self.display.message(f"{e.name()} ready after {info.load_s:.1f}s")

    def _take(self, e: _Engine, reply: Reply) -> None:
        for record in reply.records:
            sent = e.held.get(record["row"])
            if sent is None or record["sample_index"] in sent.received:
                continue  # never twice, whatever the transport does
            sent.received.add(record["sample_index"])
            self.writer.add(record)
            self.tracker.on_record(record)
        for index, outcome in reply.finished:
            if e.held.pop(index, None) is None:
                continue
            if outcome == "resumed":
                self.tracker.on_row_resumed()
            else:
                self.tracker.on_row_done(failed=outcome == "failed")
                e.rows_made += 1
        e.snap = reply.snapshot

    def _lost(self, e: _Engine, err: BaseException, dead: bool) -> None:
        e.losses += 1
        dead = dead or e.losses > MAX_RESTARTS
        rows = list(e.held.values())
        e.held.clear()
        self.retry.extendleft(reversed(rows))  # first in line, in their order
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.last_error = f"{e.name()}: {reason}"
        then = "it is not restarted" if dead else "Ray restarts it"
        self.display.message(
            f"{e.name()} was lost ({reason}); its {len(rows)} rows in flight go back to the "
            f"queue, {then}"
        )
        e.info, e.snap = None, None
        e.call = None if dead else e.handle.ready.remote()

    # ---- feeding ---------------------------------------------------------------------------
    def _rows_for(self, e: _Engine) -> list[tuple[InputRow, tuple[bytes, ...]]]:
        out = []
        limit = self._share()
        while len(e.held) < limit and not self.stop.requested:
            sent = self.retry.popleft() if self.retry else self._next_row()
            if sent is None:
                break
            e.held[sent.row.row] = sent
            out.append((sent.row, sent.keys_done()))
        return out

    def _share(self) -> int:
        """Rows an engine may hold: ROWS_PER_SLOT x max_num_seqs, and where the input's size is
        known, no more than an equal part of the rows left for the engines ready (and, within
        START_GRACE_S of the first, those still loading). Without it the first engine ready
        would take the first 3 x max_num_seqs rows alone: all of a small input, while the
        other engines idle. A JSONL count errs high (blank lines), never low."""
        total = self.tracker.rows_total
        if total is None:
            return self.depth  # a stream: its size is known at its end
        ready = sum(e.info is not None for e in self.engines)
        if time.monotonic() - self.first_ready < START_GRACE_S:
            ready += sum(e.call is not None and e.info is None for e in self.engines)
        left = total - self.tracker.rows_done
        return max(1, min(self.depth, math.ceil(left / max(1, ready))))

    def _next_row(self) -> _Sent | None:
        """The next row of the input not written before; None when none is ready."""
        while not self.exhausted:
            row = self.feed.get(wait=False)
            if row is END:
                self.exhausted = True
                self.tracker.set_total(self.rows_seen)
                return None
            if row is None:
                return None  # a pipe with nothing yet
            self.rows_seen += 1
            done = self._written(row)
            if done is None:
                self.tracker.on_row_resumed()
                continue
            return _Sent(row, done)
        return None

    def _written(self, row: InputRow) -> tuple[bytes, ...] | None:
        """Keys of the row's samples written before; None when all of them were. The engine's
        loop decides the same from the keys (a row that fails checks sample 0 only)."""
        if not self.done:
            return ()
        n = row.overrides.get("n", self.plan.defaults.n)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            n = 1  # an invalid n fails the row: one error row, sample 0
        keys = [row_key(row.id, i) for i in range(n)]
        hits = tuple(k for k in keys if k in self.done)
        return None if len(hits) == n else hits

    # ---- the display -----------------------------------------------------------------------
    def snapshot(self) -> ProgressSnapshot:
        """The driver's counts (rows, tokens: every row it received) with the engines'
        figures (slots, queues, KV cache, preemptions, rates) summed."""
        own = self.tracker.snapshot()
        live = [e.snap for e in self.engines if e.snap is not None and e.info is not None]
        if not live:
            return dataclasses.replace(own, engines=0)
        sums = ProgressSnapshot.combine(live, own.elapsed_s)
        return dataclasses.replace(
            own,
            running=sums.running,
            max_num_seqs=sums.max_num_seqs,
            waiting=sums.waiting,
            kv_blocks_used=sums.kv_blocks_used,
            kv_blocks_total=sums.kv_blocks_total,
            preemptions=sums.preemptions,
            prefill_tok_s=sums.prefill_tok_s,
            decode_tok_s=sums.decode_tok_s,
            engines=len(live),
        )
