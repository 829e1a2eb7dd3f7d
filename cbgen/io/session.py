"""One `cbgen run`: check input and output, generate (one engine, or one per worker process),
fold the finished rows into the final file, write the summary, pick the exit code.

    prepare output ─ lock it ─ open input ─ check earlier results and their settings
    ─┬─ generate_part (one engine)
     ├─ run_data_parallel (N engines)
     └─ or the caller's Generate (cbgen.ray: engines on a Ray cluster)
    ─ interrupted? message, exit 128+signal, rerun resumes
    ─ worker failed / disk full? message, exit 1, rerun resumes
    ─ finalize (atomic) ─ summary JSON ─ exit 0, or 3 when too many rows failed
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from cbgen.display import Display
from cbgen.io import identity
from cbgen.io.lease import LeaseLostError
from cbgen.io.outputs import RunLock, RunOutput
from cbgen.io.parallel import run_data_parallel
from cbgen.io.part import PartResult, RunPlan, generate_part
from cbgen.io.readers import STDIN, InputError, InputSource, open_source
from cbgen.io.schema import output_schema
from cbgen.io.stop import StopFlag
from cbgen.io.storage import StorageError
from cbgen.io.summary import build_summary, format_summary
from cbgen.io.writer import OutputError

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_USAGE = 2
EXIT_ERROR_RATE = 3
EXIT_LOCKED = 4
EXIT_SETTINGS = 5


Generate = Callable[[RunPlan, Display, StopFlag], PartResult]
"""Another way to generate the plan's rows into its staging folder (cbgen.ray: engines on a Ray
cluster fed by this process); it raises FatalError when it cannot finish."""


class FatalError(Exception):
    """Ends the run with a one-line message and exit code 1, no traceback."""


def release_memory() -> None:
    """Hand the memory the engine freed back to the OS before the final copy, so finalizing
    does not stack its buffers on top of the generation phase's peak."""
    gc.collect()
    pa.default_memory_pool().release_unused()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            trim = ctypes.CDLL(libc).malloc_trim
        except (OSError, AttributeError):  # not glibc
            return
        trim(0)


def execute(
    plan: RunPlan, display: Display, stop: StopFlag, generate: Generate | None = None
) -> int:
    """Run to the end and return the exit code. FatalError, InputError, OutputError,
    OutputLockedError and SettingsMismatchError propagate. `generate`, when given, makes the
    rows instead of this process's engine (or workers); the lock, the resume checks, the final
    file and the summary stay this function's."""
    if plan.data_parallel_size > 1 and plan.input_path == STDIN:
        raise InputError("--data-parallel-size needs an input file: workers cannot share stdin")
    source: InputSource = open_source(plan.input_path, plan.columns, plan.storage)
    try:
        schema = output_schema(source.keep_types)
    except ValueError as e:
        raise InputError(str(e)) from None
    layout: RunOutput = plan.layout
    layout.prepare()
    # a lease in a bucket can be lost (this run stalled past its expiry): stop, upload no more
    lock = layout.lock(on_lost=lambda why: stop.request(f"lost the output's lease: {why}"))
    lock.acquire()  # before anything is changed or loaded; a refused run touches nothing
    if lock.unsupported:
        display.message(
            f"warning: the output's filesystem does not support locks ({lock.unsupported}): "
            "a second run on the same output would not be stopped"
        )
    try:
        return _locked_run(plan, layout, schema, display, stop, generate, source, lock)
    finally:
        lock.release()


def _locked_run(
    plan: RunPlan,
    layout: RunOutput,
    schema: pa.Schema,
    display: Display,
    stop: StopFlag,
    generate: Generate | None,
    source: InputSource,
    lock: RunLock,
) -> int:
    t0 = time.perf_counter()
    layout.drop_stale_temps()
    if plan.overwrite:
        layout.clear()
    try:
        layout.check_compatible(schema)
        # A bad model path fails here, before any loading; this import brings in torch, so it
        # comes after the cheap checks.
        from cbgen.models.source import resolve_model

        ec = plan.engine_config
        model = resolve_model(ec.model, ec.load_format, ec.revision, ec.download_dir)
        run_id = identity.run_identity(
            plan.input_path,
            plan.columns,
            plan.engine_config,
            plan.defaults,
            model.kind,
            model.path,
            plan.chat,
            _fingerprint(source),
        )
        _check_settings(layout, run_id)
        layout.write_settings(run_id)
    except BaseException:
        layout.discard_empty_staging()
        raise
    if layout.final_exists() or layout.has_partial_results():
        display.message(f"resuming: rows already in {layout.final} or {layout.staging} are skipped")

    failures: list[str] = []
    if generate is not None:
        result = generate(plan, display, stop)
    elif plan.data_parallel_size > 1:
        result, failures = run_data_parallel(plan, display, stop)
    else:
        result, failures = _single(plan, layout, display, stop), []

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
    try:
        lock.check()  # the final file is written by the run that holds the output
    except LeaseLostError as e:
        raise FatalError(
            f"{e}; the rows this run finished are kept in {layout.staging}, for the run that "
            "holds the output now"
        ) from None
    layout.finalize(schema.with_metadata({identity.METADATA_KEY: json.dumps(run_id)}))
    stats = layout.final_stats()
    this_run = dict(result.stats, wall_s=time.perf_counter() - t0)
    settings = dict(plan.settings, engine_description=result.describe, model_commit=model.commit)
    summary = build_summary(layout.final, stats, this_run, settings)
    layout.write_summary(summary)
    if layout.export is not None:
        lines = layout.export_to(plan.output_format, model.name)
        display.message(f"{lines} lines written to {layout.export} ({plan.output_format})")
    display.message(format_summary(summary))
    display.message(f"summary: {layout.summary}")
    return _error_rate_exit(summary, plan.max_error_rate, display)


def _check_settings(layout: RunOutput, run_id: dict[str, Any]) -> None:
    """Earlier results must come from the settings of this run (staging first: it is newer)."""
    staged = layout.staged_settings()
    if staged is not None and layout.has_partial_results():
        identity.check_resume(staged, run_id, layout.staging)
    identity.check_resume(layout.final_settings(), run_id, layout.final)


def _fingerprint(source: InputSource) -> tuple[str, str]:
    """The input's name and digest (two range reads of a remote file)."""
    try:
        return source.fingerprint()
    except StorageError as e:
        raise InputError(f"input {e}") from None
    except OSError as e:
        raise InputError(f"cannot read input {source.name}: {e.strerror or e}") from None


def _single(plan: RunPlan, layout: RunOutput, display: Display, stop: StopFlag) -> PartResult:
    def ready(describe: str, startup_s: dict[str, float], done: int) -> None:
        display.message(describe)
        if done:
            display.message(f"{done} output rows already written; skipping them")
        display.start()

    snap = None
    try:
        result = generate_part(plan, plan.row_filter, display, stop, on_ready=ready)
        snap = result.snapshot
        return result
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


def _error_rate_exit(
    summary: dict[str, Any], max_error_rate: float | None, display: Display
) -> int:
    """3 when more than max_error_rate of the rows failed; by default, when all of them did."""
    rate = summary["error_rate"]
    if max_error_rate is None:
        if summary["rows"]["output"] and rate == 1.0:
            display.message(
                "every row failed (see the error column); exit code 3 "
                "(--max-error-rate 1.0 to exit 0 anyway)"
            )
            return EXIT_ERROR_RATE
        return EXIT_OK
    if rate > max_error_rate:
        display.message(
            f"error rate {100 * rate:.1f}% is above --max-error-rate {100 * max_error_rate:.1f}%"
        )
        return EXIT_ERROR_RATE
    return EXIT_OK
