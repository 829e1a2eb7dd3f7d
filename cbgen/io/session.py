"""One `cbgen run`: check input and output, generate (one engine, or one per worker process),
fold the finished rows into the final file, write the summary, pick the exit code.

    prepare output ─ open input ─ check earlier results ─┬─ generate_part (one engine)
                                                         └─ run_data_parallel (N engines)
    ─ interrupted? message, exit 128+signal, rerun resumes
    ─ worker failed? message, exit 1, rerun resumes
    ─ finalize (atomic) ─ summary JSON ─ exit 0, or 3 when the error rate is too high
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cbgen.config import EngineConfig, SamplingParams
from cbgen.display import Display, ProgressSnapshot
from cbgen.io.pipeline import GenerationLoop, ProgressTracker, StopFlag, count_rows_in_background
from cbgen.io.readers import STDIN, InputError, InputSource, open_source
from cbgen.io.rows import ColumnSpec, RowFilter
from cbgen.io.schema import output_schema
from cbgen.io.summary import build_summary, format_summary, table_stats, write_summary
from cbgen.io.writer import (
    OutputError,
    OutputLayout,
    StagingWriter,
    check_compatible,
    finalize,
    load_done_keys,
    staging_tag,
)

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_USAGE = 2
EXIT_ERROR_RATE = 3


class FatalError(Exception):
    """Ends the run with a one-line message and exit code 1, no traceback."""


@dataclass(frozen=True)
class RunPlan:
    """Everything one run (and each of its workers) needs; picklable for worker processes."""

    input_path: str
    columns: ColumnSpec
    layout: OutputLayout
    engine_config: EngineConfig
    defaults: SamplingParams
    row_filter: RowFilter = field(default_factory=RowFilter)
    data_parallel_size: int = 1
    max_error_rate: float = 1.0
    overwrite: bool = False
    gpu_ids: tuple[str, ...] = ()
    """Devices for data-parallel workers on CUDA (worker k gets gpu_ids[k]); empty on the CPU."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What the summary records about how the run was started."""


@dataclass
class PartResult:
    completed: bool
    stats: dict[str, Any]
    describe: str = ""
    snapshot: ProgressSnapshot | None = None


def generate_part(
    plan: RunPlan,
    row_filter: RowFilter,
    display: Display,
    stop: StopFlag,
    worker: int | None = None,
    on_ready: Callable[[str, float, int], None] | None = None,
    on_progress: Callable[[ProgressSnapshot], None] | None = None,
) -> PartResult:
    """Load an engine and generate the rows `row_filter` owns into a new staging stream."""
    from cbgen.engine.engine import Engine

    source = open_source(plan.input_path, plan.columns)
    schema = output_schema(source.keep_types)
    engine = Engine(plan.engine_config)
    done = load_done_keys(plan.layout)
    if on_ready is not None:
        on_ready(engine.describe(), engine.init_time_s, len(done))
    tracker = ProgressTracker(plan.engine_config.max_num_seqs)
    count_rows_in_background(source, row_filter, tracker)
    writer = StagingWriter(plan.layout.staging, schema, staging_tag(worker))
    loop = GenerationLoop(
        engine,
        source.rows(row_filter),
        writer,
        tracker,
        display,
        plan.defaults,
        done,
        stop,
        on_progress=on_progress,
        input_may_block=source.may_block,
    )
    try:
        completed = loop.run()
    finally:
        writer.close()
    stats = tracker.run_stats()
    stats["load_s"] = engine.init_time_s
    return PartResult(completed, stats, engine.describe(), tracker.snapshot())


def release_memory() -> None:
    """Hand the memory the engine freed back to the OS before the final copy, so finalizing
    does not stack its buffers on top of the generation phase's peak."""
    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            trim = ctypes.CDLL(libc).malloc_trim
        except (OSError, AttributeError):  # not glibc
            return
        trim(0)


def execute(plan: RunPlan, display: Display, stop: StopFlag) -> int:
    """Run to the end and return the exit code; FatalError/InputError/OutputError propagate."""
    t0 = time.perf_counter()
    layout = plan.layout
    if plan.data_parallel_size > 1 and plan.input_path == STDIN:
        raise InputError("--data-parallel-size needs an input file: workers cannot share stdin")
    source: InputSource = open_source(plan.input_path, plan.columns)
    try:
        schema = output_schema(source.keep_types)
    except ValueError as e:
        raise InputError(str(e)) from None
    if plan.overwrite:
        layout.clear()
    layout.prepare()
    try:
        check_compatible(layout, schema)
        # A bad model path fails here, before any loading; this import brings in torch, so it
        # comes after the cheap checks.
        from cbgen.models.loader import resolve_model

        resolve_model(plan.engine_config.model, plan.engine_config.load_format)
    except BaseException:
        layout.discard_empty_staging()
        raise
    if layout.final.exists() or layout.has_partial_results():
        display.message(f"resuming: rows already in {layout.final} or {layout.staging} are skipped")

    if plan.data_parallel_size > 1:
        from cbgen.io.parallel import run_data_parallel

        result, failures = run_data_parallel(plan, display, stop)
    else:

        def ready(describe: str, load_s: float, done: int) -> None:
            display.message(describe)
            if done:
                display.message(f"{done} output rows already written; skipping them")
            display.start()

        snap = None
        try:
            result = generate_part(plan, plan.row_filter, display, stop, on_ready=ready)
            snap = result.snapshot
        except OutputError as e:  # e.g. a full disk: what was flushed before is kept
            raise OutputError(
                f"{e}; rows finished before that are kept in {layout.staging}, rerun the same "
                "command to resume"
            ) from None
        except BaseException:
            layout.discard_empty_staging()  # e.g. the engine could not start: leave no trace
            raise
        finally:
            display.stop(snap)
        failures = []

    if failures:  # each was reported as it happened
        layout.discard_empty_staging()
        kept = (
            f"the rows finished so far are saved in {layout.staging}. Rerun the same command to resume."
            if layout.has_partial_results()
            else "no rows were written."
        )
        display.message(f"{len(failures)} of {plan.data_parallel_size} workers failed; {kept}")
        return EXIT_FATAL
    if not result.completed:
        display.message(
            f"interrupted ({stop.reason}): {result.stats['output_rows_written']} rows of this run are saved "
            f"in {layout.staging}; rerun the same command to resume."
        )
        return stop.exit_code

    release_memory()
    finalize(layout, schema)
    stats = table_stats(layout.final)
    this_run = dict(result.stats, wall_s=time.perf_counter() - t0)
    settings = dict(plan.settings, engine_description=result.describe)
    summary = build_summary(layout.final, stats, this_run, settings)
    write_summary(layout.summary, summary)
    display.message(format_summary(summary))
    display.message(f"summary: {layout.summary}")
    if summary["error_rate"] > plan.max_error_rate:
        display.message(
            f"error rate {100 * summary['error_rate']:.1f}% is above --max-error-rate "
            f"{100 * plan.max_error_rate:.1f}%"
        )
        return EXIT_ERROR_RATE
    return EXIT_OK


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' run figures as one: counts add up, times take the slowest worker."""
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if k in ("loop_s", "load_s"):
                out[k] = max(out.get(k, 0.0), v)
            else:
                out[k] = out.get(k, 0) + v
    return out
