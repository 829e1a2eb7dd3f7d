"""Where a `make bench` run's time goes, by the size of each step.

python scripts/step_costs.py [--policy continuous|static] [--num-prompts 128] [--keep steps.json]

Runs the bench's ShareGPT workload (replies up to 512 tokens, all at once, sampled at
temperature 1, exact lengths) through one policy with the engine's defaults, as `make bench`
does, and prints, for the decode-only steps grouped by batch size, the steps, their seconds
and the milliseconds a token; then the steps that also prefill. --keep writes every step's
record (duration, running, prefill and decode tokens, ...) as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from cbgen.bench.build import build_workload
from cbgen.bench.runner import StepRecord, run_workload
from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine

BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 48), (49, 63), (64, 64), (65, 1 << 30))


def report(steps: list[StepRecord]) -> None:
    total = sum(s.duration_s for s in steps)
    print(f"{len(steps)} steps, {total:.1f} s")
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    for lo, hi in BUCKETS:
        group = [s for s in decode if lo <= s.num_decode_tokens <= hi]
        if not group:
            continue
        t, n = sum(s.duration_s for s in group), sum(s.num_decode_tokens for s in group)
        name = f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
        print(
            f"  decode batch {name:>6}: {len(group):4d} steps {t:6.1f} s, {n:6d} tokens, "
            f"{1000 * t / n:5.2f} ms a token, {1000 * t / len(group):6.1f} ms a step"
        )
    mixed = [s for s in steps if s.num_prefill_tokens > 0]
    if mixed:
        t = sum(s.duration_s for s in mixed)
        p, d = sum(s.num_prefill_tokens for s in mixed), sum(s.num_decode_tokens for s in mixed)
        print(f"  with prefill: {len(mixed):4d} steps {t:6.1f} s, {p} prefill + {d} decode tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=("continuous", "static"), default="continuous")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--static-batch-size", type=int, default=8)
    ap.add_argument("--keep", default=None, help="write every step's record here (JSON)")
    args = ap.parse_args()
    engine = Engine(EngineConfig(scheduling_policy=args.policy, static_batch_size=args.static_batch_size))
    options = {"num_prompts": args.num_prompts, "seed": 0, "max_prompt_len": 1024, "max_output_len": 512}
    requests, _ = build_workload(engine, "sharegpt", options)
    run = run_workload(engine, requests, [0.0] * len(requests), label=args.policy)
    out = sum(r.output_tokens for r in run.requests)
    print(f"{args.policy}: {run.wall_s:.1f} s, {out / run.wall_s:.1f} output tokens/s")
    report(run.steps)
    if args.keep:
        with open(args.keep, "w") as f:
            json.dump([dataclasses.asdict(s) for s in run.steps], f)


if __name__ == "__main__":
    main()
