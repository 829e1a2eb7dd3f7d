"""What a prompt token costs inside a full decode step, against the same prompt alone, on SmolLM2.

python scripts/mixed_step_cost.py --prompts 64,128,400

A continuous batch takes new prompts into steps that also decode every running sequence (chunked
prefill); the static policy prefills its batches alone. This runs 64 sequences decoding (150-450
token prompts, temperature 1), then, for each prompt length, adds one request with a prompt that
long and compares the step that prefills it with the decode-only steps just before (the median of
three), three times over. A second engine then prefills the same lengths with nothing else
running. Medians of three are printed as milliseconds per prompt token.
"""

from __future__ import annotations

import argparse
import random

from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="64,128,400", help="comma-separated prompt lengths")
    ap.add_argument("--decoding", type=int, default=64, help="sequences decoding in the mixed steps")
    args = ap.parse_args()
    lengths = [int(n) for n in args.prompts.split(",")]
    rng = random.Random(0)
    one_token = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=1)
    engine = Engine(EngineConfig(max_num_seqs=args.decoding + 1, kv_cache_memory=2 << 30))
    long_run = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, seed=1)
    for i in range(args.decoding):
        engine.add_request(str(i), _prompt(rng, rng.randint(150, 450)), long_run)
    for _ in range(12):  # past the first prefill steps
        engine.step()
    mixed: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(3):
        for n in lengths:
            base = sorted(engine.step().stats.duration_s for _ in range(3))[1]
            engine.add_request(f"mixed-{n}-{rep}", _prompt(rng, n), one_token)
            stats = engine.step().stats
            assert stats.num_prefill_tokens == n and stats.num_decode_tokens == args.decoding, stats
            mixed[n].append((stats.duration_s - base) / n)
    alone_engine = Engine(EngineConfig(max_num_seqs=1, kv_cache_memory=1 << 30))
    for n in lengths:
        alone = []
        for rep in range(3):
            alone_engine.add_request(f"alone-{n}-{rep}", _prompt(rng, n), one_token)
            alone.append(alone_engine.step().stats.duration_s / n)
            while alone_engine.has_unfinished_requests():
                alone_engine.step()
        m, a = sorted(mixed[n])[1] * 1000, sorted(alone)[1] * 1000
        print(
            f"prompt of {n:4d} tokens: {m:.2f} ms a token beside {args.decoding} decodes, "
            f"{a:.2f} ms alone ({m / a:.2f}x)"
        )


if __name__ == "__main__":
    main()
