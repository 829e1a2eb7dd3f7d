"""`cbgen run` against the same run under `--ray` with one engine, in interleaved pairs, so the
cost of Ray (the driver feeding an actor, rows and results crossing processes) is measured on
the same machine minutes apart and a drift of the machine's speed hits both sides alike; then
the output of two engines of one CPU each against the plain run's, row for row.

    python -m tools.ray_bench --sharegpt 64 --pairs 3 [-- more cbgen run options]
    python -m tools.ray_bench --rows prompts.jsonl --pairs 1 --ray 127.0.0.1:6379

--sharegpt N: N ShareGPT requests as tools.sharegpt_rows makes them (seed 0, prompts of 4-256
tokens before the chat template, replies up to --max-output-len tokens, ignore_eos so each row
makes exactly that many), greedy. Each pair runs both commands with --overwrite (so both
generate every row), the plain one first in even pairs and the Ray one first in odd ones:

    plain:  cbgen run DIR/rows.jsonl -o DIR/plain.parquet ...
    ray:    cbgen run DIR/rows.jsonl -o DIR/ray.parquet ... --ray local --ray-engines 1

One engine on a local cluster takes all the machine's CPUs, as the plain run's engine does. For
each run: its wall time as a whole process (a local cluster's start included) and the loop's
total (prompt + output) tokens/s from its summary (this_run, from the first engine ready to the
last row written); per pair the ratio ray / plain of both (wall: plain seconds over Ray
seconds); the medians at the end. Then `--ray local --cpus-per-engine 1` (an engine per CPU)
once, its rows compared with the last plain run's on every column but the latencies, the
preemptions and the prefix cache's hits (which depend on which engine a row met). The load
average before each run goes into the record: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cbgen.io.schema import LATENCY_COLUMNS
from tools.object_store_bench import timed
from tools.sharegpt_rows import sharegpt_rows

NOT_COMPARED = frozenset((*LATENCY_COLUMNS, "num_preemptions", "cached_tokens"))


def run_side(args: list[str], out: Path) -> dict[str, Any]:
    """One `cbgen run`: its wall, its loop's throughput and the load average it started under."""
    load = os.getloadavg()[0]
    wall = timed(args, dict(os.environ))
    this_run = json.loads(out.with_suffix(".summary.json").read_text())["this_run"]
    return {
        "wall_s": wall,
        "total_tokens_per_s": this_run["total_tokens_per_s"],
        "output_tokens_per_s": this_run["output_tokens_per_s"],
        "loop_s": this_run["loop_s"],
        "load_1min_before": load,
    }


def rows_of(path: Path) -> list[dict[str, Any]]:
    table = pq.read_table(path).sort_by([("row", "ascending"), ("sample_index", "ascending")])
    return [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in table.to_pylist()]


def compare(plain: Path, ray: Path) -> dict[str, Any]:
    """Whether the two outputs hold the same rows; the ids of those that differ."""
    want, got = rows_of(plain), rows_of(ray)
    differ = [w["id"] for w, g in zip(want, got, strict=False) if w != g]
    same = len(want) == len(got) and not differ
    return {"rows": len(want), "rows_ray": len(got), "identical": same, "differing_ids": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=Path, help="a JSONL file of rows")
    source.add_argument("--sharegpt", type=int, metavar="N", help="N ShareGPT requests")
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--ray", default="local", metavar="ADDRESS", help="the cluster (default: one per run)"
    )
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("cbgen_args", nargs="*", help="more `cbgen run` options (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = folder / "rows.jsonl"
        workload: dict[str, Any] = {"rows": str(args.rows)} if args.rows else {}
        if args.rows is not None:
            rows.write_bytes(args.rows.read_bytes())
        else:
            data, stats = sharegpt_rows(args.sharegpt, args.max_output_len)
            rows.write_text("".join(json.dumps(r) + "\n" for r in data))
            workload = {"sharegpt": args.sharegpt, "max_output_len": args.max_output_len, **stats}
        common = ["--temperature", "0", "--overwrite", "--log-interval", "600"]
        common += args.cbgen_args
        outs = {side: folder / f"{side}.parquet" for side in ("plain", "ray", "ray2")}
        sides = {side: ["run", str(rows), "-o", str(out), *common] for side, out in outs.items()}
        sides["ray"] += ["--ray", args.ray, "--ray-engines", "1"]
        sides["ray2"] += ["--ray", args.ray, "--cpus-per-engine", "1"]
        pairs = []
        for i in range(args.pairs):
            order = ("plain", "ray") if i % 2 == 0 else ("ray", "plain")
            pair: dict[str, Any] = {"first": order[0]}
            for side in order:
                pair[side] = run_side(sides[side], outs[side])
            pair["total_tok_s_ratio"] = (
                pair["ray"]["total_tokens_per_s"] / pair["plain"]["total_tokens_per_s"]
            )
            pair["wall_ratio"] = pair["plain"]["wall_s"] / pair["ray"]["wall_s"]
            pairs.append(pair)
            print(
                f"pair {i} ({order[0]} first): total tok/s plain "
                f"{pair['plain']['total_tokens_per_s']:.1f}, ray "
                f"{pair['ray']['total_tokens_per_s']:.1f} -> {pair['total_tok_s_ratio']:.3f}x; "
                f"wall plain {pair['plain']['wall_s']:.1f} s, ray {pair['ray']['wall_s']:.1f} s"
                f" -> {pair['wall_ratio']:.3f}x",
                flush=True,
            )
        two = run_side(sides["ray2"], outs["ray2"])
        identity = dict(compare(outs["plain"], outs["ray2"]), run=two)
        print(
            f"two engines of one CPU each: {identity['rows_ray']} rows, "
            f"{'identical to' if identity['identical'] else 'DIFFERENT from'} the plain run's "
            f"{identity['rows']} ({len(identity['differing_ids'])} differ)",
            flush=True,
        )
    result = {
        "workload": workload,
        "cpus": len(os.sched_getaffinity(0)),
        "cbgen_args": args.cbgen_args,
        "pairs": pairs,
        "median_total_tok_s_ratio": statistics.median(p["total_tok_s_ratio"] for p in pairs),
        "median_wall_ratio": statistics.median(p["wall_ratio"] for p in pairs),
        "two_engines": identity,
    }
    print(
        f"ray (one engine) / plain, median of {len(pairs)} pairs: total tok/s "
        f"{result['median_total_tok_s_ratio']:.3f}x, whole process {result['median_wall_ratio']:.3f}x"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
