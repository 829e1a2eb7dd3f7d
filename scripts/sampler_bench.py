"""Time one Sampler call at temperature 1 (what `cbgen bench` samples at) over a SmolLM2-sized
vocabulary, with the C kernel (cbgen/attention/csrc/sample.c) and with the torch ops alone.

python scripts/sampler_bench.py --rows 8,64 [--vocab 49152] [--temperature 1.0]

Each call gets a fresh copy of the same logits (the torch path works in place), copied before
the clock starts. Prints the median milliseconds a call for each row count and path.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from cbgen.attention import native
from cbgen.config import SamplingParams
from cbgen.engine.sampler import Sampler, SamplingRow


def time_calls(logits: torch.Tensor, rows: list[SamplingRow], repeats: int) -> float:
    sampler = Sampler()
    sampler(logits.clone(), rows)  # warm-up (and the kernels' first build)
    times = []
    for _ in range(repeats):
        x = logits.clone()
        t0 = time.perf_counter()
        sampler(x, rows)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: the kernel cannot be built here")
    print(f"threads={torch.get_num_threads()} vocab={args.vocab} temperature={args.temperature}")
    params = SamplingParams(temperature=args.temperature)
    for b in (int(r) for r in args.rows.split(",")):
        logits = 3 * torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(0))
        rows = [SamplingRow(params, [1, 2, 3], 3, torch.Generator().manual_seed(i), []) for i in range(b)]
        kernel = time_calls(logits, rows, args.repeats)
        with mock.patch.object(native, "sample", lambda *a: None):
            ops = time_calls(logits, rows, args.repeats)
        print(f"{b:4d} rows: C kernel {1e3 * kernel:6.2f} ms   torch ops {1e3 * ops:6.2f} ms")


if __name__ == "__main__":
    main()
