"""`cbgen run` on local files against the same run read from and written to a bucket on a local S3
server (moto's, tools.s3_server), in interleaved pairs, so the cost of object storage is measured
on the same machine minutes apart and a drift of the machine's speed hits both sides alike.

    python -m tools.object_store_bench --sharegpt 64 --pairs 3 [-- more cbgen run options]
    python -m tools.object_store_bench --rows prompts.jsonl --pairs 3

--sharegpt N: N ShareGPT requests as tools.sharegpt_rows makes them (seed 0, prompts of 4-256
tokens before the chat template, replies up to --max-output-len tokens, ignore_eos so each row
makes exactly that many), greedy. Each pair runs both commands with --overwrite (so both
generate every row), the local one first in even pairs and the bucket one first in odd ones:

    local:  cbgen run DIR/rows.jsonl -o DIR/local.parquet ...
    bucket: cbgen run s3://bench/rows.jsonl -o s3://bench/out.parquet ...

For each run: its wall time as a whole process (start-up, the lease, the final upload and the
summary included) and the loop's output tokens/s from its summary; per pair the ratio bucket /
local of both throughputs (wall: local seconds over bucket seconds); the medians at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.s3_server import S3Server
from tools.sharegpt_rows import sharegpt_rows


def timed(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", "from cbgen.cli import main; main()", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"cbgen run {' '.join(args[1:3])} failed:\n{r.stdout[-2000:]}{r.stderr}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=Path, help="a JSONL file of rows")
    source.add_argument("--sharegpt", type=int, metavar="N", help="N ShareGPT requests")
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("cbgen_args", nargs="*", help="more `cbgen run` options (after --)")
    args = parser.parse_args()

    server = S3Server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            rows = folder / "rows.jsonl"
            if args.rows is not None:
                rows.write_bytes(args.rows.read_bytes())
            else:
                data, _ = sharegpt_rows(args.sharegpt, args.max_output_len)
                rows.write_text("".join(json.dumps(r) + "\n" for r in data))
            server.bucket("bench")
            server.put("bench", "rows.jsonl", rows.read_bytes())
            env = dict(os.environ, **server.env(folder))
            common = ["--temperature", "0", "--overwrite", "--log-interval", "600"]
            common += args.cbgen_args
            sides = {
                "local": ["run", str(rows), "-o", str(folder / "local.parquet"), *common],
                "bucket": ["run", "s3://bench/rows.jsonl", "-o", "s3://bench/out.parquet", *common],
            }
            pairs = []
            for i in range(args.pairs):
                order = ("local", "bucket") if i % 2 == 0 else ("bucket", "local")
                pair: dict[str, Any] = {}
                for side in order:
                    wall = timed(sides[side], env)
                    summary = json.loads(
                        (folder / "local.summary.json").read_text()
                        if side == "local"
                        else server.client()
                        .get_object(Bucket="bench", Key="out.summary.json")["Body"]
                        .read()
                    )
                    pair[side] = {
                        "wall_s": wall,
                        "output_tokens_per_s": summary["this_run"]["output_tokens_per_s"],
                    }
                pair["wall_ratio"] = pair["local"]["wall_s"] / pair["bucket"]["wall_s"]
                pair["loop_ratio"] = (
                    pair["bucket"]["output_tokens_per_s"] / pair["local"]["output_tokens_per_s"]
                )
                pairs.append(pair)
                print(
                    f"pair {i}: wall local {pair['local']['wall_s']:.1f} s, bucket "
                    f"{pair['bucket']['wall_s']:.1f} s -> {pair['wall_ratio']:.3f}x; loop output "
                    f"tok/s local {pair['local']['output_tokens_per_s']:.1f}, bucket "
                    f"{pair['bucket']['output_tokens_per_s']:.1f} -> {pair['loop_ratio']:.3f}x",
                    flush=True,
                )
    finally:
        server.stop()
    result = {
        "pairs": pairs,
        "median_wall_ratio": statistics.median(p["wall_ratio"] for p in pairs),
        "median_loop_ratio": statistics.median(p["loop_ratio"] for p in pairs),
    }
    print(
        f"bucket / local throughput, median of {len(pairs)} pairs: whole process "
        f"{result['median_wall_ratio']:.3f}x, loop {result['median_loop_ratio']:.3f}x"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
