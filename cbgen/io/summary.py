"""The run summary: a small JSON file beside the output, and the lines printed at the end.

Counts, tokens and latency percentiles describe the whole output file (rows resumed from
earlier runs included), read back column by column in record batches so memory stays small;
wall time and throughput describe this run, and this_run.startup_s its start-up: the total and
the seconds spent building the CPU kernels, tuning them and loading the model (cbgen.phases;
both 0 where the kernels were cached, the rest "other"), the slowest worker's for each.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cbgen.cpu.features import cpu_info
from cbgen.display import format_duration, format_startup

SUMMARY_LATENCIES = ("queue_s", "ttft_s", "tpot_s", "itl_p50_s", "itl_p99_s", "e2e_s")
_PERCENTILES = (50, 90, 99)
_BATCH = 16384


def table_stats(path: Path | pa.NativeFile) -> dict[str, Any]:
    """Counts, token totals, preemptions and latency percentiles of an output file (a path, or
    an open file in a bucket)."""
    pf = pq.ParquetFile(path)
    rows = ok = failed = inputs = 0
    reasons: dict[str, int] = {}
    prompt = cached = completion = preemptions = 0
    cols = [
        "sample_index",
        "finish_reason",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "num_preemptions",
    ]
    for b in pf.iter_batches(batch_size=_BATCH, columns=cols):
        t = pa.Table.from_batches([b])
        rows += t.num_rows
        is_ok = pc.not_equal(t["finish_reason"], "error")
        n_ok = int(pc.sum(is_ok).as_py() or 0)
        ok += n_ok
        failed += t.num_rows - n_ok
        inputs += int(pc.sum(pc.equal(t["sample_index"], 0)).as_py() or 0)
        for item in pc.value_counts(t["finish_reason"]).to_pylist():
            reasons[item["values"]] = reasons.get(item["values"], 0) + item["counts"]
        ok_t = t.filter(is_ok)
        prompt += _sum(ok_t["prompt_tokens"])
        cached += _sum(ok_t["cached_tokens"])
        completion += _sum(ok_t["completion_tokens"])
        preemptions += _sum(t["num_preemptions"])
    latency = {name: _percentiles(pf, name) for name in SUMMARY_LATENCIES}
    return {
        "rows": {"output": rows, "ok": ok, "failed": failed, "input_rows": inputs},
        "finish_reasons": dict(sorted(reasons.items())),
        "error_rate": failed / rows if rows else 0.0,
        "tokens": {
            "prompt": prompt,
            "completion": completion,
            "cached": cached,
            "cache_hit_rate": cached / prompt if prompt else 0.0,
        },
        "total_preemptions": preemptions,
        "latency_s": latency,
    }


def _sum(col: pa.ChunkedArray) -> int:
    v = pc.sum(col).as_py()
    return int(v) if v is not None else 0


def _percentiles(pf: pq.ParquetFile, column: str) -> dict[str, float | None]:
    parts = []
    for b in pf.iter_batches(batch_size=_BATCH, columns=[column]):
        arr = b.column(0).drop_null().to_numpy(zero_copy_only=False)
        if len(arr):
            parts.append(arr.astype(np.float64))
    if not parts:
        return {"mean": None, **{f"p{q}": None for q in _PERCENTILES}, "max": None}
    values = np.concatenate(parts)
    return {
        "mean": float(values.mean()),
        **{f"p{q}": float(np.percentile(values, q)) for q in _PERCENTILES},
        "max": float(values.max()),
    }


def build_summary(
    output: Path | str,
    stats: dict[str, Any],
    this_run: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    from cbgen import __version__

    wall = this_run.get("wall_s") or 0.0
    gen_rows = this_run.get("rows_generated", 0)
    prompt_t = this_run.get("prompt_tokens", 0)
    comp_t = this_run.get("completion_tokens", 0)
    run = dict(this_run)
    loop = this_run.get("loop_s") or 0.0
    run.update(
        rows_per_s=gen_rows / loop if loop else 0.0,
        output_tokens_per_s=comp_t / loop if loop else 0.0,
        total_tokens_per_s=(prompt_t + comp_t) / loop if loop else 0.0,
    )
    return {
        "cbgen_version": __version__,
        "output": str(output),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **stats,
        "this_run": run,
        "wall_s": wall,
        # the host's model and the flags its fast paths were chosen by: figures name their CPU
        "cpu": cpu_info().describe(),
        **settings,
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Atomically (temp file, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(summary_json(summary))
    os.replace(tmp, path)


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, default=_json_default) + "\n"


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def _startup(run: dict[str, Any]) -> str:
    """'start-up 48.2s: build 20.1s, tune 25.3s, load 2.1s'; a summary of a run without the
    phases' seconds has the whole start-up (load_s) alone."""
    startup = run.get("startup_s") or {"total": run.get("load_s") or 0.0}
    return format_startup(startup)


def format_summary(summary: dict[str, Any]) -> str:
    rows, tok, run = summary["rows"], summary["tokens"], summary["this_run"]
    lat = summary["latency_s"]

    def ms(name: str, q: str) -> str:
        v = lat.get(name, {}).get(q)
        return "-" if v is None else f"{1000 * v:.0f}ms"

    lines = [
        f"output: {summary['output']}",
        f"rows: {rows['output']} written ({rows['ok']} ok, {rows['failed']} failed, error rate "
        f"{100 * summary['error_rate']:.1f}%); this run generated {run['rows_generated']} rows, "
        f"resumed {run['rows_resumed']}",
        f"tokens: {tok['prompt']} prompt ({100 * tok['cache_hit_rate']:.1f}% from the prefix cache), "
        f"{tok['completion']} completion; {summary['total_preemptions']} preemptions",
        f"this run: {format_duration(summary['wall_s'])} wall ({_startup(run)}), "
        f"{run['rows_per_s']:.2f} rows/s, {run['output_tokens_per_s']:.1f} output tok/s, "
        f"{run['total_tokens_per_s']:.1f} total tok/s",
        f"latency p50/p99: queue {ms('queue_s', 'p50')}/{ms('queue_s', 'p99')}, ttft "
        f"{ms('ttft_s', 'p50')}/{ms('ttft_s', 'p99')}, tpot {ms('tpot_s', 'p50')}/{ms('tpot_s', 'p99')}, "
        f"e2e {ms('e2e_s', 'p50')}/{ms('e2e_s', 'p99')}",
    ]
    return "\n".join(lines)
