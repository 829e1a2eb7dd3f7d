"""Time one Sampler call at temperature 1 (what `cbgen bench` samples at) over a SmolLM2-sized
vocabulary, with the C kernel (cbgen/attention/csrc/sample.c) and with the torch ops alone.

python scripts/sampler_bench.py --rows 8,64 [--vocab 49152] [--temperature 1.0]

Each call gets a fresh copy of the same logits (the torch path works in place), copied before
the clock starts; the first call is an untimed warm-up (and builds the kernels). Prints the
median milliseconds a call for each row count and path.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native
from cbgen.config import SamplingParams
from cbgen.engine.sampler import Sampler, SamplingRow


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
    sampler = Sampler()
    for b in (int(r) for r in args.rows.split(",")):
        logits = 3 * torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(0))
        rows = [SamplingRow(params, [1, 2, 3], 3, torch.Generator().manual_seed(i), []) for i in range(b)]

        def call(x: torch.Tensor, rows: list[SamplingRow] = rows) -> None:
            sampler(x, rows)

        kernel = median_time(call, args.repeats, setup=logits.clone)
        with mock.patch.object(native, "sample", lambda *a: None):
            ops = median_time(call, args.repeats, setup=logits.clone)
        print(f"{b:4d} rows: C kernel {1e3 * kernel:6.2f} ms   torch ops {1e3 * ops:6.2f} ms")


if __name__ == "__main__":
    main()
