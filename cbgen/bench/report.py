"""What a benchmark run reports: the summary figures of each run, the Rich table, the JSON
document and the per-request Parquet file.

Throughputs count useful tokens only (the prompt and output tokens of the requests), over the
wall time from the first arrival to the last finish; padding is reported apart, as the share of
all computed tokens that went to padding. computed_tokens_per_s counts every token the model
computed (padding, and prompt tokens computed again after a preemption, included; prefix-cache
hits excluded): how fast the hardware ran, whatever the tokens were for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cbgen.bench.runner import RunResult
from cbgen.metrics import percentile

Summary = dict[str, Any]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarize(run: RunResult) -> Summary:
    """The figures of one run (times in seconds, shares in [0, 1])."""
    ok = [r for r in run.requests if r.error is None]
    wall = run.wall_s
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)

    def vals(name: str) -> list[float]:
        return [v for r in ok if (v := getattr(r, name)) is not None]

    ttft, tpot, queue, e2e = vals("ttft_s"), vals("tpot_s"), vals("queue_s"), vals("e2e_s")
    itls = [x for r in ok for x in r.itls_s]
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in run.steps)
    busy = sum(s.num_running * s.duration_s for s in run.steps)
    padding = run.padding
    # Decode-only steps (no prompt token in them): the per-token cost at the batch size the
    # policy runs, the figure that says whether larger batches are cheaper on this hardware.
    decode_steps = [
        st for st in run.steps if st.num_prefill_tokens == 0 and st.num_decode_tokens > 0
    ]
    decode_time = sum(st.duration_s for st in decode_steps)
    return {
        "policy": run.policy,
        "overrides": dict(run.overrides),
        "num_requests": len(run.requests),
        "num_errors": len(run.requests) - len(ok),
        "wall_s": wall,
        "warmup_s": run.warmup_s,
        "num_steps": len(run.steps),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / wall if wall > 0 else math.nan,
        "output_tokens_per_s": output_tokens / wall if wall > 0 else math.nan,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall if wall > 0 else math.nan,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "itl_p99_s": percentile(itls, 99),
        "queue_mean_s": _mean(queue),
        "queue_p99_s": percentile(queue, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "computed_tokens": computed,
        "computed_tokens_per_s": computed / wall if wall > 0 else math.nan,
        "step_mean_s": _mean([st.duration_s for st in run.steps]),
        "decode_steps": len(decode_steps),
        "decode_batch_mean": _mean([st.num_decode_tokens for st in decode_steps]),
        "decode_step_mean_s": decode_time / len(decode_steps) if decode_steps else math.nan,
        "decode_tokens_per_s": sum(st.num_decode_tokens for st in decode_steps) / decode_time
        if decode_time > 0
        else math.nan,
        "pad_tokens": padding.num_pad_tokens if padding else 0,
        "discarded_tokens": padding.num_discarded_tokens if padding else 0,
        "padding_waste": padding.waste if padding else 0.0,
        "slots": run.slots,
        "slot_occupancy": busy / (wall * run.slots) if wall > 0 else math.nan,
        "num_preemptions": run.num_preemptions,
        "peak_kv_usage": max(
            (s.num_kv_blocks_used / max(s.num_kv_blocks_total, 1) for s in run.steps), default=0.0
        ),
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "step_cached_tokens": sum(s.num_cached_tokens for s in run.steps),
        "other_load": run.other_load,
        **run.extra,
    }


RATIO_KEYS = (
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "itl_p99_s",
    "queue_mean_s",
    "queue_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "computed_tokens_per_s",
    "step_mean_s",
    "decode_step_mean_s",
    "decode_tokens_per_s",
    "wall_s",
)


def ratios(a: Summary, b: Summary) -> dict[str, float]:
    """a / b for every figure where both are finite and b is not 0."""
    out = {}
    for k in RATIO_KEYS:
        x, y = a.get(k), b.get(k)
        if (
            isinstance(x, (int, float))
            and isinstance(y, (int, float))
            and math.isfinite(x)
            and math.isfinite(y)
            and y != 0
        ):
            out[k] = x / y
    return out


# ---- the table ---------------------------------------------------------------------------
def _s(v: float) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "-"
    return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _n(v: float, digits: int = 1) -> str:
    return f"{v:,.{digits}f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


ROWS: tuple[tuple[str, str, Any], ...] = (
    ("requests/s", "requests_per_s", lambda v: _n(v, 2)),
    ("output tokens/s", "output_tokens_per_s", _n),
    ("total tokens/s", "total_tokens_per_s", _n),
    ("TTFT mean", "ttft_mean_s", _s),
    ("TTFT p50", "ttft_p50_s", _s),
    ("TTFT p99", "ttft_p99_s", _s),
    ("TPOT p50", "tpot_p50_s", _s),
    ("TPOT p99", "tpot_p99_s", _s),
    ("ITL p99", "itl_p99_s", _s),
    ("queue wait mean", "queue_mean_s", _s),
    ("queue wait p99", "queue_p99_s", _s),
    ("end-to-end p50", "e2e_p50_s", _s),
    ("end-to-end p99", "e2e_p99_s", _s),
    ("computed tokens/s", "computed_tokens_per_s", _n),
    ("step time mean", "step_mean_s", _s),
    ("decode step: batch", "decode_batch_mean", _n),
    ("decode step: time", "decode_step_mean_s", _s),
    ("decode tokens/s", "decode_tokens_per_s", _n),
    ("padding waste", "padding_waste", _pct),
    ("slot occupancy", "slot_occupancy", _pct),
    ("cache hit rate", "cache_hit_rate", _pct),
    ("preemptions", "num_preemptions", lambda v: str(v)),
    ("peak KV use", "peak_kv_usage", _pct),
    ("steps", "num_steps", lambda v: str(v)),
    ("errors", "num_errors", lambda v: str(v)),
    ("wall time", "wall_s", _s),
    ("other load (cores)", "other_load", lambda v: _n(v, 2)),
)


def render_table(
    results: Mapping[str, Summary],
    ratio_columns: Mapping[str, dict[str, float]],
    title: str,
) -> Any:
    """A Rich table: one row per figure, one column per run, then one per ratio."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("")
    for label in results:
        table.add_column(label, justify="right")
    for label in ratio_columns:
        table.add_column(label, justify="right", style="bold")
    for name, key, fmt in ROWS:
        cells = [fmt(s[key]) for s in results.values()]
        cells += [f"{r[key]:.2f}x" if key in r else "" for r in ratio_columns.values()]
        table.add_row(name, *cells)
    return table


def ratio_line(name: str, r: Mapping[str, float]) -> str:
    """One line: the headline ratios of two runs."""
    parts = [
        f"{r[k]:.2f}x {label}"
        for k, label in (
            ("output_tokens_per_s", "output tokens/s"),
            ("ttft_p99_s", "TTFT p99"),
            ("queue_p99_s", "queue wait p99"),
            ("e2e_p99_s", "end-to-end p99"),
        )
        if k in r
    ]
    return f"{name}: " + ", ".join(parts)


# ---- files -------------------------------------------------------------------------------
def _clean(v: Any) -> Any:
    """JSON has no NaN: a figure that does not exist (no samples) is null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(
    path: str | Path,
    workload: Mapping[str, Any],
    engine: Mapping[str, Any],
    results: Mapping[str, Summary],
    ratio_columns: Mapping[str, dict[str, float]],
) -> None:
    doc = {
        "workload": dict(workload),
        "engine": dict(engine),
        "results": dict(results),
        "ratios": dict(ratio_columns),
    }
    Path(path).write_text(json.dumps(_clean(doc), indent=2, default=str) + "\n", encoding="utf-8")


PARQUET_COLUMNS = (
    "id",
    "prompt_tokens",
    "output_len",
    "output_tokens",
    "cached_tokens",
    "num_preemptions",
    "finish_reason",
    "error",
    "arrival_s",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "itl_p50_s",
    "itl_p99_s",
    "itl_max_s",
    "e2e_s",
)


def write_parquet(path: str | Path, runs: Sequence[RunResult]) -> None:
    """One row per request and run: `run` (the column label), `policy`, then PARQUET_COLUMNS."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list[Any]] = {"run": [], "policy": [], **{c: [] for c in PARQUET_COLUMNS}}
    for run in runs:
        for r in run.requests:
            cols["run"].append(run.label)
            cols["policy"].append(run.policy)
            for c in PARQUET_COLUMNS:
                cols[c].append(getattr(r, "request_id" if c == "id" else c))
    schema = pa.schema(
        [
            ("run", pa.string()),
            ("policy", pa.string()),
            ("id", pa.string()),
            *(
                (c, pa.int64())
                for c in (
                    "prompt_tokens",
                    "output_len",
                    "output_tokens",
                    "cached_tokens",
                    "num_preemptions",
                )
            ),
            ("finish_reason", pa.string()),
            ("error", pa.string()),
            *((c, pa.float64()) for c in PARQUET_COLUMNS[8:]),
        ]
    )
    pq.write_table(pa.table(cols, schema=schema), path)
