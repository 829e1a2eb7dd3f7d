"""One part of a run: the plan every process shares, and one engine generating the rows a
row filter owns into a new staging stream (the whole run, or one data-parallel worker)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cbgen.config import EngineConfig
from cbgen.display import Display, ProgressSnapshot
from cbgen.io.bucket import BucketLayout
from cbgen.io.pipeline import GenerationLoop
from cbgen.io.progress import ProgressTracker, count_rows_in_background
from cbgen.io.readers import open_source
from cbgen.io.rows import ChatDefaults, ColumnSpec
from cbgen.io.schema import output_schema
from cbgen.io.shard import RowFilter
from cbgen.io.stop import StopFlag
from cbgen.io.storage import Storage
from cbgen.io.writer import OutputLayout, staging_tag
from cbgen.phases import StartupTimes, listening
from cbgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class RunPlan:
    """Everything one run (and each of its workers) needs; picklable for worker processes."""

    input_path: str
    columns: ColumnSpec
    layout: OutputLayout | BucketLayout
    engine_config: EngineConfig
    defaults: SamplingParams
    row_filter: RowFilter = field(default_factory=RowFilter)
    data_parallel_size: int = 1
    max_error_rate: float | None = None
    """Exit 3 above this fraction of failed rows; None: only when every row failed."""
    overwrite: bool = False
    chat: ChatDefaults = field(default_factory=ChatDefaults)
    output_format: str = "parquet"
    """parquet, or jsonl / openai: exported from the Parquet record at the end."""
    gpu_ids: tuple[str, ...] = ()
    """Devices for data-parallel workers on CUDA (worker k gets gpu_ids[k]); empty on the CPU."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What the summary records about how the run was started."""
    storage: Storage = field(default_factory=Storage)
    """--storage-option: how URLs of the input and output are reached."""


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
    on_ready: Callable[[str, dict[str, float], int], None] | None = None,
    on_progress: Callable[[ProgressSnapshot], None] | None = None,
) -> PartResult:
    """Load an engine and generate the rows `row_filter` owns into a new staging stream. The
    engine's start-up phases go to display.phase as they happen; on_ready gets the engine's
    description, its start-up seconds (StartupTimes.as_dict) and the rows already written."""
    from cbgen.engine.engine import Engine

    source = open_source(plan.input_path, plan.columns, plan.storage)
    schema = output_schema(source.keep_types)
    times = StartupTimes()
    with listening(times.record, display.phase):
        engine = Engine(plan.engine_config)
    startup = times.as_dict(engine.init_time_s)
    done = plan.layout.done_keys()
    if on_ready is not None:
        on_ready(engine.describe(), startup, len(done))
    tracker = ProgressTracker(plan.engine_config.max_num_seqs)
    count_rows_in_background(source, row_filter, tracker)
    writer = plan.layout.staging_writer(schema, staging_tag(worker))
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
        chat=plan.chat,
    )
    try:
        completed = loop.run()
    finally:
        writer.close()
    stats = tracker.run_stats()
    stats["load_s"] = engine.init_time_s
    stats["startup_s"] = startup
    return PartResult(completed, stats, engine.describe(), tracker.snapshot())


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' run figures as one: counts add up, times take the slowest worker (start-up's
    each kind of phase apart)."""
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if k in ("loop_s", "load_s"):
                out[k] = max(out.get(k, 0.0), v)
            elif k == "startup_s":
                seen = out.setdefault(k, {})
                out[k] = {kind: max(seen.get(kind, 0.0), s) for kind, s in v.items()}
            else:
                out[k] = out.get(k, 0) + v
    return out
