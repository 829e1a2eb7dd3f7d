"""--data-parallel-size N: N engine processes on one machine, one output.

    parent ──spawn──▶ worker k (k < N): its own engine (GPU k on CUDA), the rows
       ▲               r with (r // shard_count) % N == k, its own staging stream
       └── one Pipe per worker: phase / ready / progress / done / error messages

A Pipe per worker (not a shared Queue) means a worker killed mid-message cannot leave a lock
held that would block the others. The parent waits on every pipe and every process sentinel
at once, so a worker that dies is reported as soon as it dies; the others carry on and their
rows are kept, and the run ends with exit code 1 and a rerun resumes. SIGTERM/Ctrl-C are
forwarded to the workers, which flush and stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import psutil

from cbgen.display import Display, ProgressSnapshot
from cbgen.io.part import PartResult, RunPlan, generate_part, merge_stats
from cbgen.io.readers import InputError
from cbgen.io.stop import StopFlag
from cbgen.io.writer import OutputError
from cbgen.phases import listening

_PROGRESS_EVERY_S = 0.5


def worker_main(plan: RunPlan, index: int, conn: mpc.Connection) -> None:
    """Entry point of worker `index` (a spawned process)."""
    stop = StopFlag()
    stop.install()
    if plan.gpu_ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.gpu_ids[index]
    config = plan.engine_config
    if config.num_threads is None and config.device != "cuda":
        cores = len(psutil.Process().cpu_affinity() or [0])
        config = config.replace(num_threads=max(1, cores // plan.data_parallel_size))
    plan = dataclasses.replace(plan, engine_config=config)
    last = 0.0

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            stop.request("parent gone")  # the parent died: flush and stop

    def on_ready(describe: str, startup_s: dict[str, float], done: int) -> None:
        send(("ready", describe, startup_s, done))

    def on_phase(kind: str, text: str, seconds: float | None) -> None:
        send(("phase", kind, text, seconds))

    def on_progress(snap: ProgressSnapshot) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= _PROGRESS_EVERY_S:
            last = now
            send(("progress", snap))

    try:
        row_filter = plan.row_filter.split(plan.data_parallel_size, index)
        with listening(on_phase):
            result = generate_part(
                plan,
                row_filter,
                Display(sys.stderr),
                stop,
                worker=index,
                on_ready=on_ready,
                on_progress=on_progress,
            )
        send(("done", result.completed, result.stats, stop.reason, result.snapshot))
    except BaseException as e:  # report anything, then exit non-zero
        if isinstance(e, (ValueError, InputError, OutputError, KeyboardInterrupt)):
            message = str(e) or type(e).__name__  # ours: the message says it all
        else:
            traceback.print_exc()  # unexpected: the details go to stderr
            message = "".join(traceback.format_exception_only(type(e), e)).strip()
        send(("error", message))
        conn.close()
        sys.exit(1)
    conn.close()


@dataclass
class _Worker:
    index: int
    process: Any
    conn: mpc.Connection
    snap: ProgressSnapshot
    open: bool = True
    result: tuple[bool, dict[str, Any], str | None] | None = None
    error: str | None = None
    failure: str | None = None
    exited: bool = False
    describe: str = ""
    phases: list[tuple[str, str, float | None]] = field(default_factory=list)
    """Start-up phases received and not yet shown (cbgen.phases: kind, text, seconds)."""


def run_data_parallel(
    plan: RunPlan, display: Display, stop: StopFlag
) -> tuple[PartResult, list[str]]:
    """Run the workers to the end; returns the merged result and one message per failed worker."""
    ctx = mp.get_context("spawn")
    n = plan.data_parallel_size
    workers: list[_Worker] = []
    for k in range(n):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker_main, args=(plan, k, send), name=f"cbgen-worker-{k}")
        proc.start()
        send.close()  # only the worker writes; EOF then means the worker is gone
        workers.append(
            _Worker(k, proc, recv, ProgressSnapshot.empty(plan.engine_config.max_num_seqs))
        )
    display.message(
        f"data parallel: {n} workers (pids {', '.join(str(w.process.pid) for w in workers)})"
    )
    started = time.perf_counter()
    forwarded = False
    display_started = False
    failures: list[str] = []
    try:
        while not all(w.exited for w in workers):
            waitables: list[Any] = [w.conn for w in workers if w.open]
            waitables += [w.process.sentinel for w in workers if not w.exited]
            mpc.wait(waitables, timeout=0.25)
            for w in workers:
                _drain(w)
                for phase in w.phases:
                    display.phase(*phase)
                w.phases.clear()
                if w.describe and w.index == 0 and not display_started:
                    display.message(w.describe)
                    display.start()
                    display_started = True
                if not w.exited and not w.process.is_alive():
                    w.process.join()
                    _drain(w)
                    w.exited = True
                    w.failure = _failure(w)
                    if w.failure is not None:
                        failures.append(w.failure)
                        display.message(w.failure)
            if stop.requested and not forwarded:
                forwarded = True
                for w in workers:
                    if not w.exited:
                        _signal(w.process.pid, signal.SIGTERM)
            if display_started:
                display.update(
                    ProgressSnapshot.combine(
                        [w.snap for w in workers], time.perf_counter() - started
                    )
                )
    finally:
        display.stop(
            ProgressSnapshot.combine([w.snap for w in workers], time.perf_counter() - started)
            if display_started
            else None
        )
        for w in workers:
            if w.process.is_alive():  # only on an exception in this loop
                w.process.terminate()
                w.process.join(10)
    results = [w.result for w in workers if w.result is not None]
    completed = len(results) == n and all(r[0] for r in results)
    stats = merge_stats([r[1] for r in results])
    stats.setdefault("output_rows_written", 0)
    return PartResult(completed, stats, workers[0].describe), failures


def _drain(w: _Worker) -> None:
    while w.open:
        try:
            if not w.conn.poll():
                return
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.open = False
            return
        kind = msg[0]
        if kind == "phase":
            w.phases.append((msg[1], f"worker {w.index}: {msg[2]}", msg[3]))
        elif kind == "ready":
            w.describe = msg[1]
        elif kind == "progress":
            w.snap = msg[1]
        elif kind == "done":
            w.result = (msg[1], msg[2], msg[3])
            if msg[4] is not None:
                w.snap = msg[4]
        elif kind == "error":
            w.error = msg[1]


def _failure(w: _Worker) -> str | None:
    """None for a worker that reported its end; otherwise what went wrong."""
    pid, code = w.process.pid, w.process.exitcode
    if w.error is not None:
        return f"worker {w.index} (pid {pid}) failed: {w.error}"
    if w.result is not None and code == 0:
        return None
    if code is not None and code < 0:
        return f"worker {w.index} (pid {pid}) was killed by {signal.Signals(-code).name}"
    return f"worker {w.index} (pid {pid}) exited with code {code} without finishing"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
