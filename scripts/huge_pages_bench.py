"""Decode steps with the packed matmul weights in 4 KiB pages against 2 MiB pages, on SmolLM2.

python scripts/huge_pages_bench.py --rows 8,16,64

For each batch size, two engines are built in one process, one with its panels in ordinary
memory and one in cbgen's huge-page arena (cbgen.attention.native.HugePageArena), and given
the same requests (random prompts of 150-450 tokens, sampled at temperature 1, ignore_eos).
Their steps alternate, so the host's drift hits both alike; the medians of the steps where
every sequence decodes are compared. Needs transparent huge pages (`madvise` or `always` in
/sys/kernel/mm/transparent_hugepage/enabled).
"""

from __future__ import annotations

import argparse
import functools
import random

from timing import alternating_decode_steps, median  # scripts/timing.py

from cbgen.attention import native
from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine


def all_unfinished(engines: list[Engine]) -> bool:
    return all(e.has_unfinished_requests() for e in engines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=300, help="mean prompt length")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per engine")
    args = ap.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        engines = {}
        for huge in (False, True):
            native._WEIGHT_ARENA = native.HugePageArena()  # packing happens while the engine loads
            native._WEIGHT_ARENA.huge = huge and native._WEIGHT_ARENA.huge
            engines[huge] = Engine(EngineConfig(max_num_seqs=rows, kv_cache_memory=2 << 30))
        params = SamplingParams(temperature=1.0, max_tokens=args.steps, ignore_eos=True, seed=1)
        for engine in engines.values():
            rng = random.Random(0)
            for i in range(rows):
                n = rng.randint(args.prompt // 2, args.prompt * 3 // 2)
                engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(n)], params)
        steps = {huge: (lambda e=engine: e.step().stats) for huge, engine in engines.items()}
        times = alternating_decode_steps(steps, rows, functools.partial(all_unfinished, list(engines.values())))
        small, big = (median(times[h]) * 1000 for h in (False, True))
        print(
            f"{rows:3d} sequences: 4 KiB pages {small:6.1f} ms, 2 MiB pages {big:6.1f} ms a step "
            f"({small / big:.3f}x, medians of {len(times[True])} steps)"
        )
    native._WEIGHT_ARENA = native.HugePageArena()


if __name__ == "__main__":
    main()
