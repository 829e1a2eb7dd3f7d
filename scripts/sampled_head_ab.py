"""Sampled decode steps through the float32 LM head against the bf16 head, on SmolLM2.

python scripts/sampled_head_ab.py --rows 8,64 [--temperature 1]

One engine per batch size, given that many requests (random prompts of 150-450 tokens,
sampled at the temperature, ignore_eos). Its steps alternate between the two heads (the bf16
head switched off and on; nothing else changes), so the host's drift hits both alike; the
medians of the steps where every sequence decodes are compared.
"""

from __future__ import annotations

import argparse
import random

from timing import alternating_decode_steps, median  # scripts/timing.py

from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import StepStats
from cbgen.models.llama import Bf16Head


def switch(engine: Engine, head: Bf16Head | None) -> StepStats:
    """One step of engine with its model's bf16 head set to head (None: the float32 head)."""
    engine.runner.model.bf16_head = head
    return engine.step().stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=300, help="mean prompt length")
    ap.add_argument("--steps", type=int, default=60, help="decode steps")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        engine = Engine(EngineConfig(max_num_seqs=rows, kv_cache_memory=2 << 30))
        model = engine.runner.model
        head = model.bf16_head
        if head is None:
            raise SystemExit("no bf16 head on this machine (needs the C kernels and native bf16 matmuls)")
        params = SamplingParams(temperature=args.temperature, max_tokens=args.steps, ignore_eos=True, seed=1)
        rng = random.Random(0)
        for i in range(rows):
            n = rng.randint(args.prompt // 2, args.prompt * 3 // 2)
            engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(n)], params)
        steps = {bf16: (lambda bf16=bf16, e=engine, h=head: switch(e, h if bf16 else None)) for bf16 in (False, True)}
        times = alternating_decode_steps(steps, rows, engine.has_unfinished_requests)
        f32, b16 = (median(times[h]) * 1000 for h in (False, True))
        print(
            f"{rows:3d} sequences: float32 head {f32:6.1f} ms, bf16 head {b16:6.1f} ms a step "
            f"({f32 / b16:.3f}x, medians of {len(times[True])} steps)"
        )


if __name__ == "__main__":
    main()
