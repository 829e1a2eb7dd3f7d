"""`cbgen bench`: continuous against static batching (or any engine knob) on one workload.

load the model once ─▶ build the workload ─▶ for each column (policy x sweep point):
    fresh Engine sharing the weights ─▶ warm-up ─▶ timed run ─▶ summary
─▶ table (+ ratio line), and --output-json / --output-parquet / --plot

Inside each timed run (cbgen.bench.probes): --profile's window of steps, --alternate's two
paths; over its requests: --structured's JSON schema (cbgen.bench.structured).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from cbgen.bench.probes import AlternateSpec, ProfileSpec, parse_alternate
from cbgen.bench.structured import Structured, parse_structured
from cbgen.cli_options import NO_ENGINE_OPTIONS, EngineOptions, engine_options
from cbgen.config import EngineConfig, parse_size
from cbgen.cpu.features import cpu_info
from cbgen.models.errors import ModelFileError

if TYPE_CHECKING:
    from cbgen.engine.engine import Engine

WORKLOADS = ("sharegpt", "random", "file", "prefix")
POLICIES = ("continuous", "static")
_HOLDER_KV_BYTES = 64 << 20
"""KV cache of the engine that only holds the weights (the measured engines share them)."""
_NOT_SWEEPABLE = {
    "revision",
    "download_dir",
    "model",
    "load_format",
    "device",
    "dtype",
    "attention_backend",
    "scheduling_policy",
    "seed",
}


def _default(name: str) -> Any:
    return EngineConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class Column:
    label: str
    policy: str
    overrides: dict[str, Any]
    repeat: int = 1
    """1 for a sweep value's first column, 2 for the same value given again (its label gets
    " #2"), and so on: repeating a value measures the run-to-run spread."""


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """'max_num_seqs=1,8,32' -> ('max_num_seqs', [1, 8, 32]); the knob is an EngineConfig field."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    if not sep or not values.strip():
        raise ValueError(f"sweep: expected KNOB=V1,V2,... got {text!r}")
    if name not in fields or name in _NOT_SWEEPABLE:
        allowed = sorted(set(fields) - _NOT_SWEEPABLE)
        raise ValueError(f"sweep: {name!r} is not a knob to sweep; one of {', '.join(allowed)}")
    kind = type(_default(name)) if _default(name) is not None else int
    out: list[Any] = []
    for raw in values.split(","):
        v = raw.strip()
        try:
            if kind is bool:
                if v.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(v)
                out.append(v.lower() in ("true", "1"))
            elif name == "kv_cache_memory":
                out.append(parse_size(v))
            else:
                out.append(kind(v))
        except ValueError:
            raise ValueError(f"sweep: {v!r} is not a valid {name}") from None
    return name, out


def _point_name(overrides: dict[str, Any], repeat: int) -> str:
    """'max_num_seqs=64', and 'max_num_seqs=64 #2' for its second run."""
    return " ".join(f"{k}={v}" for k, v in overrides.items()) + (
        f" #{repeat}" if repeat > 1 else ""
    )


def plan_columns(
    policy: str, compare: str | None, sweep: tuple[str, list[Any]] | None
) -> list[Column]:
    policies = [policy] if compare is None or compare == policy else [policy, compare]
    if sweep is None:
        return [Column(p, p, {}) for p in policies]
    knob, values = sweep
    columns = []
    seen: dict[Any, int] = {}
    for v in values:
        repeat = seen[v] = seen.get(v, 0) + 1
        point = _point_name({knob: v}, repeat)
        for p in policies:
            columns.append(
                Column(point if len(policies) == 1 else f"{p} {point}", p, {knob: v}, repeat)
            )
    return columns


@engine_options(exclude=("scheduling_policy", "seed"))  # --policy and --seed below
def bench(
    workload: str = typer.Option("sharegpt", help="sharegpt | random | file | prefix"),
    num_prompts: int = typer.Option(48, help="Requests in the workload."),
    seed: int = typer.Option(
        0, help="Shuffles and draws the workload, arrivals and sampling; seeds dummy weights."
    ),
    dataset_path: str | None = typer.Option(
        None, help="file: the JSONL to run; sharegpt: another copy of the ShareGPT JSON."
    ),
    max_prompt_len: int = typer.Option(1024, help="sharegpt: drop prompts longer than this."),
    max_output_len: int | None = typer.Option(
        None, help="sharegpt: cap reply lengths (a capped request keeps the cap)."
    ),
    chat_template: bool | None = typer.Option(
        None,
        "--chat-template/--no-chat-template",
        help="Wrap text prompts in the chat template [default: when the model has one].",
    ),
    input_len: int = typer.Option(256, help="random: mean prompt length."),
    output_len: int = typer.Option(128, help="random and prefix: (mean) output length."),
    range_ratio: float = typer.Option(0.0, help="random: lengths uniform in [L(1-r), L(1+r)]."),
    prefix_len: int = typer.Option(512, help="prefix: tokens in each shared prefix."),
    num_prefixes: int = typer.Option(8, help="prefix: distinct prefixes, taken in turn."),
    suffix_len: int = typer.Option(32, help="prefix: private tokens after the prefix."),
    policy: str = typer.Option("continuous", help="continuous | static"),
    compare: str | None = typer.Option(
        None, help="Run this policy too, on the same requests (e.g. static)."
    ),
    request_rate: float | None = typer.Option(
        None, help="Poisson arrivals, requests/s [default: all at once]."
    ),
    sweep: str | None = typer.Option(
        None,
        help="One column per value of an engine knob, e.g. max_num_seqs=1,8,32,64 (a value given again is a repeat).",
    ),
    num_warmup: int = typer.Option(4, help="Short requests run on each engine before timing."),
    structured: str | None = typer.Option(
        None,
        help="Constrain outputs to a JSON schema: json (the bench's own: topic, summary, "
        "keywords, sentiment) or a schema file. A constrained request stops when its JSON is "
        "complete.",
    ),
    structured_share: float = typer.Option(
        1.0, help="--structured: the share of requests constrained (0.5: every other one)."
    ),
    profile: str | None = typer.Option(
        None,
        help="Profile a window of each timed run's steps and print the table: torch (torch's "
        "ops; CUDA kernels on a GPU) | cprofile (Python calls, the C kernels by call site).",
    ),
    profile_steps: int = typer.Option(10, help="--profile: steps profiled."),
    profile_after: int = typer.Option(10, help="--profile: timed steps run before them."),
    alternate: str | None = typer.Option(
        None,
        help="Steps alternate two at a time between the engine's own path and another, in one "
        "run, and each path's step times are printed: exact_head (against the float32 head) | "
        "decoder (one C call against the Python forward) | small_gemm_max_rows=ROWS | "
        "blocked_rows=ROWS (CPU).",
    ),
    output_json: str | None = typer.Option(None, help="Write the figures as JSON."),
    output_parquet: str | None = typer.Option(None, help="Write one row per request and run."),
    plot: str | None = typer.Option(
        None, help="Write slots-in-use and TTFT plots (PNG; needs matplotlib)."
    ),
    engine: EngineOptions = NO_ENGINE_OPTIONS,
) -> None:
    """Benchmark continuous against static batching on real (ShareGPT) or synthetic traffic."""
    try:
        if workload not in WORKLOADS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}; got {workload!r}")
        if policy not in POLICIES or (compare is not None and compare not in POLICIES):
            raise ValueError(f"policy and compare: must be one of {', '.join(POLICIES)}")
        if num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
        if workload == "file" and dataset_path is None:
            raise ValueError("dataset_path: --workload file needs --dataset-path")
        if structured is None and structured_share != 1.0:
            raise ValueError("structured_share: needs --structured")
        constraint = None if structured is None else parse_structured(structured, structured_share)
        profile_spec = (
            None if profile is None else ProfileSpec(profile, profile_steps, profile_after)
        )
        alternate_spec = None if alternate is None else parse_alternate(alternate)
        config = engine.config(scheduling_policy=policy, seed=seed)
        columns = plan_columns(policy, compare, parse_sweep(sweep) if sweep else None)
        for c in columns:
            config.replace(scheduling_policy=c.policy, **c.overrides)  # validates every column now
        workload_options = dict(
            num_prompts=num_prompts,
            seed=seed,
            dataset_path=dataset_path,
            max_prompt_len=max_prompt_len,
            max_output_len=max_output_len,
            chat_template=chat_template,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            prefix_len=prefix_len,
            num_prefixes=num_prefixes,
            suffix_len=suffix_len,
            request_rate=request_rate,
        )
        run_bench(
            workload,
            workload_options,
            config,
            columns,
            num_warmup=num_warmup,
            output_json=output_json,
            output_parquet=output_parquet,
            plot=plot,
            structured=constraint,
            profile=profile_spec,
            alternate=alternate_spec,
        )
    except ModelFileError as e:  # the options were fine, the model's files are not
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def run_bench(
    workload: str,
    options: dict[str, Any],
    config: EngineConfig,
    columns: list[Column],
    *,
    num_warmup: int = 4,
    output_json: str | None = None,
    output_parquet: str | None = None,
    plot: str | None = None,
    weights: Engine | None = None,
    structured: Structured | None = None,
    profile: ProfileSpec | None = None,
    alternate: AlternateSpec | None = None,
) -> dict[str, Any]:
    """Load once, build the workload, run every column; print and write the report.
    Returns the JSON document (workload, engine, results, ratios). weights: an Engine already
    holding this model's weights (same model, dtype and device), to skip loading. structured:
    the requests' constraint; profile, alternate: what to watch inside each timed run."""
    from rich.console import Console

    from cbgen.bench import report
    from cbgen.bench.build import build_workload, describe_workload
    from cbgen.bench.probes import Probes
    from cbgen.bench.runner import bench_params, run_workload
    from cbgen.bench.workloads import poisson_arrivals
    from cbgen.engine.engine import Engine

    err = Console(stderr=True)
    knobs = {k for c in columns for k in c.overrides}
    holder_config = config.replace(
        kv_cache_memory=_HOLDER_KV_BYTES,
        max_model_len=None if "max_model_len" in knobs else config.max_model_len,
        scheduling_policy="continuous",
    )
    holder = weights if weights is not None else Engine(holder_config)
    err.print(f"model loaded in {holder.load_time_s:.1f} s")
    requests, workload_info = build_workload(holder, workload, options)
    arrivals = poisson_arrivals(len(requests), options.get("request_rate"), options["seed"])
    workload_info.update(describe_workload(requests))
    if structured is not None:
        workload_info["structured"] = structured.describe(len(requests))
    err.print(
        f"workload {workload}: {len(requests)} requests, "
        f"{workload_info['prompt_tokens']} prompt + {workload_info['output_tokens']} output tokens"
    )

    runs = []
    notes = []
    description = ""
    for c in columns:
        engine = Engine(
            config.replace(scheduling_policy=c.policy, **c.overrides), share_weights_with=holder
        )
        description = description or engine.describe()
        if structured is not None:  # ValueError if it does not compile; compiled before timing
            engine.grammars.compile(structured.spec)
        probes = Probes(engine.runtime, engine.device.type == "cuda", profile, alternate)
        err.print(f"running {c.label} ...")
        t0 = time.perf_counter()

        def report_progress(
            done: int, total: int, tokens: int, elapsed: float, label: str = c.label
        ) -> None:
            err.print(
                f"  {label}: {done}/{total} requests done, {tokens} output tokens, {elapsed:.0f} s"
            )

        run = run_workload(
            engine,
            requests,
            arrivals,
            label=c.label,
            seed=options["seed"],
            num_warmup=num_warmup,
            progress=report_progress,
            params=bench_params if structured is None else structured.params,
            hooks=probes.hooks,
        )
        run.overrides = dict(c.overrides)
        notes.append(probes.collect(run))
        runs.append(run)
        err.print(
            f"  {c.label}: {run.wall_s:.1f} s timed ({time.perf_counter() - t0:.1f} s with warm-up)"
        )
        del engine
        gc.collect()
        if output_json:  # the columns so far: a long run interrupted keeps what it measured
            results = {r.label: report.summarize(r) for r in runs}
            report.write_json(
                output_json, workload_info, _engine_info(holder, description, config), results, {}
            )

    results = {run.label: report.summarize(run) for run in runs}
    ratio_columns = _ratio_columns(columns, results)
    engine_info = _engine_info(holder, description, config)
    out = Console(file=sys.stdout)
    out.print(f"{description}; model load {holder.load_time_s:.1f} s (not timed)")
    title = f"cbgen bench: {workload}, {len(requests)} requests" + (
        f", {options['request_rate']:g} req/s" if options.get("request_rate") else ", all at once"
    )
    out.print(report.render_table(results, ratio_columns, title))
    for name, r in ratio_columns.items():
        out.print(report.ratio_line(name, r))
    for note in filter(None, notes):  # tables of their own: printed as they are
        out.print(note, markup=False, highlight=False, soft_wrap=True)
    if output_json:
        report.write_json(output_json, workload_info, engine_info, results, ratio_columns)
    if output_parquet:
        report.write_parquet(output_parquet, runs)
    if plot:
        from cbgen.bench.plot import write_plot

        write_plot(plot, runs, title=f"{workload}, {len(requests)} requests, {holder.source.name}")
    return {
        "workload": workload_info,
        "engine": engine_info,
        "results": results,
        "ratios": ratio_columns,
    }


def _engine_info(holder: Engine, description: str, config: EngineConfig) -> dict[str, Any]:
    return {
        "model": holder.source.name,
        "description": description,
        "load_time_s": holder.load_time_s,
        "device": str(holder.device),
        "dtype": holder.dtype_name,
        "cpu": cpu_info().describe(),
        "config": {k: v for k, v in config.to_dict().items() if k != "scheduling_policy"},
    }


def _ratio_columns(columns: list[Column], results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """continuous / static for every point where both policies ran."""
    from cbgen.bench.report import ratios

    points: dict[tuple[tuple[tuple[str, Any], ...], int], dict[str, str]] = {}
    for c in columns:
        points.setdefault((tuple(sorted(c.overrides.items())), c.repeat), {})[c.policy] = c.label
    out = {}
    for (key, repeat), labels in points.items():
        if "continuous" in labels and "static" in labels:
            suffix = _point_name(dict(key), repeat)
            name = "continuous / static" + (f" {suffix}" if suffix else "")
            out[name] = ratios(results[labels["continuous"]], results[labels["static"]])
    return out
