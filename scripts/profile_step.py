"""Profile cbgen on SmolLM2: N requests of random prompt lengths, fixed output length.

python scripts/profile_step.py --num 64 --prompt 88 --output 128 [--temperature 1] [--torch-profile | --cprofile]

--torch-profile sees torch ops only; --cprofile also times the C kernels (called through ctypes),
per call site, over the same 10 steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=88)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument(
        "--profile-after", type=int, default=10, help="profile 10 steps after this many"
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling (cbgen bench uses 1)"
    )
    ap.add_argument("--sort", default="tottime", help="--cprofile: pstats sort key (tottime, cumtime, ...)")
    ap.add_argument("--rows", type=int, default=15, help="--cprofile: rows to print")
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format=args.load_format,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.budget,
            kv_cache_memory=2 << 30,
        )
    )
    print(f"init {time.perf_counter() - t0:.1f}s threads={torch.get_num_threads()}")
    rng = random.Random(0)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.output, ignore_eos=True, seed=1 if args.temperature else None
    )
    for i in range(args.num):
        n = rng.randint(args.prompt // 2, args.prompt * 3 // 2)
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(n)], params)
    prof = None
    cprof: cProfile.Profile | None = None
    t0 = time.perf_counter()
    steps, ptoks, dtoks = [], 0, 0
    while engine.has_unfinished_requests():
        if args.torch_profile and len(steps) == args.profile_after:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        if prof is not None and len(steps) == args.profile_after + 10:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            prof = None
        if args.cprofile and len(steps) == args.profile_after:
            cprof = cProfile.Profile()
            cprof.enable()
        if cprof is not None and len(steps) == args.profile_after + 10:
            cprof.disable()
            profiled = steps[args.profile_after :]
            print(f"10 steps ({sum(n for _, _, n in profiled)} decode tokens), {sum(d for d, _, _ in profiled):.3f} s:")
            pstats.Stats(cprof).sort_stats(args.sort).print_stats(args.rows)
            cprof = None
        out = engine.step()
        s = out.stats
        steps.append((s.duration_s, s.num_prefill_tokens, s.num_decode_tokens))
        ptoks += s.num_prefill_tokens
        dtoks += s.num_decode_tokens
    wall = time.perf_counter() - t0
    out_tokens = args.num * args.output
    decode_only = sorted(d for d, p, n in steps if p == 0 and n == args.max_num_seqs)
    print(
        f"wall {wall:.2f}s steps {len(steps)} prompt {ptoks} out {out_tokens} "
        f"total tok/s {(ptoks + out_tokens) / wall:.1f} out tok/s {out_tokens / wall:.1f}"
    )
    if decode_only:
        print(
            f"full decode step median {1000 * decode_only[len(decode_only) // 2]:.1f} ms ({len(decode_only)} steps)"
        )


if __name__ == "__main__":
    main()
