"""`cbgen run INPUT [-o OUTPUT] [options]`: JSONL or Parquet in, Parquet out; either may be a
URL (s3://, gs://; http(s):// for the input), with --storage-option for what the standard
environment does not configure.

Engine options map one to one onto EngineConfig fields and sampling options onto
SamplingParams fields (a row's own fields override them); the defaults shown by --help are
read from those dataclasses. Environment variables (Slurm's array variables,
CUDA_VISIBLE_DEVICES) are read here and in cbgen.run_options, nowhere below. The work itself is cbgen.io.session;
under --ray, engines on a Ray cluster generate (cbgen.ray.driver) while this process still
reads, writes, locks and resumes. Option values that need reading or resolving (files, JSON,
the shard, Ray's options) are cbgen.run_options'.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from cbgen.io.session import Generate
    from cbgen.ray.cluster import RayOptions

from cbgen.cli_options import (
    NO_ENGINE_OPTIONS,
    NO_SAMPLING_OPTIONS,
    EngineOptions,
    SamplingOptions,
    engine_options,
    sampling_options,
)
from cbgen.config import DEFAULT_MODEL, EngineConfig
from cbgen.run_options import (
    chat_defaults,
    parse_ray_options,
    resolve_shard,
    structured_defaults,
)

IO_PANEL = "Input and output"
CHAT_PANEL = "Chat (rows with messages)"
RUN_PANEL = "Run"
RAY_PANEL = "Ray cluster (pip install 'cbgen[ray]')"
STRUCTURED_PANEL = "Structured outputs (run-wide; a row's own constraint wins)"


# --seed is EngineConfig.seed, the base of every row's seed; structured_outputs is given as
# --json-schema, --regex or --choice
@sampling_options(exclude=("seed", "structured_outputs"))
@engine_options()
def run(
    input: Annotated[
        str,
        typer.Argument(
            help="Prompts: a .jsonl file (- for stdin) or a .parquet file; or a URL: s3://, gs:// (one object, or a prefix of Parquet/JSONL files read in name order), http(s):// (e.g. a presigned URL).",
            show_default=False,
        ),
    ],
    # ---- input and output ----------------------------------------------------------------
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            rich_help_panel=IO_PANEL,
            show_default="INPUT's stem + .out.parquet beside it",
            help="Output Parquet file (with --shard: a folder of part files); or s3:// / gs:// (ending in /: a folder of parts).",
        ),
    ] = None,
    storage_option: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=IO_PANEL,
            show_default="the standard environment (AWS_PROFILE, AWS_ENDPOINT_URL, ...)",
            help="KEY=VALUE for s3:// and gs:// (repeatable): endpoint_url (MinIO, Ceph), region, access_key, secret_key, session_token, anonymous, ...",
        ),
    ] = None,
    flush_rows: Annotated[
        int,
        typer.Option(
            rich_help_panel=IO_PANEL,
            min=1,
            help="s3:// and gs:// outputs: finished rows are uploaded as a part object every this many rows (or --flush-interval); a killed run loses at most that window.",
        ),
    ] = 4096,
    flush_interval: Annotated[
        float,
        typer.Option(
            rich_help_panel=IO_PANEL,
            min=0.1,
            help="s3:// and gs:// outputs: seconds between part uploads at most.",
        ),
    ] = 15.0,
    lease_duration: Annotated[
        float,
        typer.Option(
            rich_help_panel=IO_PANEL,
            min=1.0,
            help="s3:// and gs:// outputs: seconds the output's lease lasts without renewal (renewed every quarter of it); a run that died holds the output this long.",
        ),
    ] = 60.0,
    prompt_column: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=IO_PANEL,
            show_default="prompt, else messages",
            help="Field/column holding the prompt: text or token ids, or a list of {role, content} messages (the chat template is applied).",
        ),
    ] = None,
    id_column: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=IO_PANEL,
            show_default="id (custom_id for OpenAI batch rows), else the row index",
            help="Field/column holding each row's id; rerunning skips ids already written.",
        ),
    ] = None,
    keep_columns: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=IO_PANEL,
            show_default="none",
            help="Input fields/columns copied to the output (comma-separated or repeated). Parquet keeps their types; JSONL values become text (non-strings as JSON).",
        ),
    ] = None,
    output_format: Annotated[
        str,
        typer.Option(
            rich_help_panel=IO_PANEL,
            help="parquet, jsonl (one object per row) or openai (OpenAI Batch API output lines); auto: jsonl when OUTPUT ends in .jsonl. jsonl and openai keep the Parquet file beside as the run's record.",
        ),
    ] = "auto",
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            rich_help_panel=IO_PANEL,
            help="Delete an existing output and its partial results first, instead of resuming.",
        ),
    ] = False,
    # ---- chat ----------------------------------------------------------------------------
    chat_template: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=CHAT_PANEL,
            show_default="the model's own",
            help="A Jinja chat template file for `messages` rows, instead of the model's.",
        ),
    ] = None,
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=CHAT_PANEL,
            show_default="none",
            help="JSON object of template variables, e.g. '{\"enable_thinking\": false}'; a row's own chat_template_kwargs add to and override them.",
        ),
    ] = None,
    # ---- structured outputs -------------------------------------------------------------
    json_schema: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=STRUCTURED_PANEL,
            show_default="none",
            help="A JSON schema file: every completion is JSON of that schema (a row's own structured_outputs or response_format wins).",
        ),
    ] = None,
    regex: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=STRUCTURED_PANEL,
            show_default="none",
            help="Every completion fully matches this regular expression.",
        ),
    ] = None,
    choice: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=STRUCTURED_PANEL,
            show_default="none",
            help="Every completion is one of these strings (repeat for each choice).",
        ),
    ] = None,
    # ---- run -----------------------------------------------------------------------------
    shard: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=RUN_PANEL,
            show_default="from SLURM_ARRAY_TASK_ID/COUNT in a Slurm job array, else every row",
            help="I/N: process the rows with row % N == I and write OUTPUT/part-I-of-N.parquet. --shard 0/1 processes every row, even inside a job array.",
        ),
    ] = None,
    data_parallel_size: Annotated[
        int,
        typer.Option(
            rich_help_panel=RUN_PANEL,
            min=1,
            help="Engine processes on this machine (one per GPU on CUDA), each on its share of the rows; one output.",
        ),
    ] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            rich_help_panel=RAY_PANEL,
            metavar="[ADDRESS]",
            show_default="off",
            help="Run the engines on a Ray cluster: a bare --ray (or local) starts one on this machine for the run; auto joins the cluster this machine belongs to (ray start, RAY_ADDRESS); or HOST:PORT, ray://HOST:10001. One engine per GPU, or per --cpus-per-engine CPUs on CPU nodes; this process reads, writes and resumes as ever.",
        ),
    ] = None,
    cpus_per_engine: Annotated[
        float | None,
        typer.Option(
            rich_help_panel=RAY_PANEL,
            min=0.01,
            show_default="GPU engines 1; CPU engines the smallest node's CPUs (with --ray-engines, the cluster's split between them)",
            help="CPUs each engine reserves under --ray; a CPU engine runs that many threads.",
        ),
    ] = None,
    ray_engines: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=RAY_PANEL,
            min=1,
            show_default="as many as the cluster holds",
            help="Engines to start under --ray; those that do not fit wait for room (an autoscaling cluster adds nodes).",
        ),
    ] = None,
    max_error_rate: Annotated[
        float | None,
        typer.Option(
            rich_help_panel=RUN_PANEL,
            min=0.0,
            max=1.0,
            show_default="exit 3 only when every row failed",
            help="Exit with code 3 when more than this fraction of the output rows failed (1.0: never).",
        ),
    ] = None,
    log_interval: Annotated[
        float,
        typer.Option(
            rich_help_panel=RUN_PANEL,
            min=0.01,
            help="Seconds between status lines when stdout is not a terminal (cron, Slurm logs).",
        ),
    ] = 10.0,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            rich_help_panel=RUN_PANEL,
            help="Print only the final summary (and errors).",
        ),
    ] = False,
    engine: EngineOptions = NO_ENGINE_OPTIONS,
    sampling: SamplingOptions = NO_SAMPLING_OPTIONS,
) -> None:
    """Generate completions for every row of INPUT into a Parquet file.

    Rows already in OUTPUT (by id) are skipped, so rerunning the same command resumes after a
    crash, kill or time limit; a resume with settings that change outputs is refused. One run
    at a time holds OUTPUT. Exit codes: 0 done; 1 fatal error, failed worker or every engine
    of the Ray cluster lost; 2 bad options;
    3 too many failed rows (--max-error-rate; by default when every row failed); 4 another run
    holds OUTPUT; 5 earlier results have other settings; 130/143 interrupted (resumable).
    """
    from cbgen.display import make_display
    from cbgen.io.export import resolve_format
    from cbgen.io.identity import SettingsMismatchError
    from cbgen.io.lock import OutputLockedError
    from cbgen.io.outputs import build_output
    from cbgen.io.part import RunPlan
    from cbgen.io.readers import InputError
    from cbgen.io.rows import ColumnSpec
    from cbgen.io.session import (
        EXIT_FATAL,
        EXIT_LOCKED,
        EXIT_SETTINGS,
        EXIT_USAGE,
        FatalError,
        execute,
    )
    from cbgen.io.shard import RowFilter
    from cbgen.io.stop import StopFlag
    from cbgen.io.storage import Storage, StorageError
    from cbgen.io.writer import OutputError

    display = make_display(quiet, log_interval)
    try:
        config = engine.config()
        defaults = sampling.params()
        structured = structured_defaults(json_schema, regex, choice)
        if structured is not None:
            defaults = defaults.replace(structured_outputs=structured)
        the_shard = resolve_shard(shard, display)
        keep = tuple(c.strip() for item in keep_columns or [] for c in item.split(",") if c.strip())
        chat = chat_defaults(chat_template, chat_template_kwargs)
        ray_options = parse_ray_options(ray, cpus_per_engine, ray_engines, data_parallel_size)
        fmt = resolve_format(output_format, output)
        storage = Storage.parse(storage_option or [])
        storage.check([input, output or ""])
        layout = build_output(
            input,
            output,
            the_shard,
            fmt != "parquet",
            storage,
            flush_rows=flush_rows,
            flush_interval_s=flush_interval,
            lease_s=lease_duration,
        )
    except ValueError as e:
        _fail(str(e), EXIT_USAGE)
    except OutputError as e:
        _fail(str(e), EXIT_FATAL)
    generate = _ray_generate(ray_options)

    settings: dict[str, Any] = {
        "input": input,
        "shard": None if the_shard is None else str(the_shard),
        "data_parallel_size": data_parallel_size,
        "ray": None if ray_options is None else dataclasses.asdict(ray_options),
        "model": config.model or DEFAULT_MODEL,
        "engine": config.to_dict(),
        "sampling_defaults": dataclasses.asdict(defaults),
        "max_error_rate": max_error_rate,
        "chat_template": chat_template,
        "chat_template_kwargs": chat.kwargs,
    }
    plan = RunPlan(
        input_path=input,
        columns=ColumnSpec(prompt_column, id_column, keep),
        layout=layout,
        engine_config=config,
        defaults=defaults,
        row_filter=the_shard.filter if the_shard is not None else RowFilter(),
        data_parallel_size=data_parallel_size,
        max_error_rate=max_error_rate,
        overwrite=overwrite,
        chat=chat,
        output_format=fmt,
        gpu_ids=_gpu_ids(config, data_parallel_size),
        settings=settings,
        storage=storage,
    )
    stop_flag = StopFlag()
    restore = stop_flag.install()
    try:
        code = execute(plan, display, stop_flag, generate)
    except OutputLockedError as e:
        display.stop()
        _fail(str(e), EXIT_LOCKED)
    except SettingsMismatchError as e:
        display.stop()
        _fail(str(e), EXIT_SETTINGS)
    except (InputError, OutputError, FatalError, StorageError, ValueError) as e:
        display.stop()
        _fail(str(e), EXIT_FATAL)
    except KeyboardInterrupt:
        display.stop()
        _fail(
            f"interrupted; finished rows are saved in {layout.staging}, rerun the same command to resume",
            130,
        )
    finally:
        restore()
    raise typer.Exit(code)


def _gpu_ids(config: EngineConfig, data_parallel_size: int) -> tuple[str, ...]:
    """One device per data-parallel worker when the engine runs on CUDA, else none."""
    if data_parallel_size == 1 or config.device == "cpu":
        return ()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        if config.device == "cuda":
            _fail("--device cuda: no CUDA device is visible", 2)
        return ()  # auto on a machine without CUDA: CPU workers
    if len(ids) < data_parallel_size:
        _fail(
            f"--data-parallel-size {data_parallel_size} needs {data_parallel_size} GPUs, {len(ids)} visible",
            2,
        )
    return tuple(ids[:data_parallel_size])


def _ray_generate(options: RayOptions | None) -> Generate | None:
    """The session's Generate for --ray; without Ray installed, exit 1 saying how to get it."""
    if options is None:
        return None
    from cbgen.io.session import EXIT_FATAL
    from cbgen.ray.cluster import RayError, import_ray
    from cbgen.ray.driver import generate_on_ray

    try:
        import_ray()
    except RayError as e:
        _fail(str(e), EXIT_FATAL)
    return functools.partial(generate_on_ray, options)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
