"""Time the LM head of a SmolLM2-sized vocabulary (49,152 x 576) from cold caches: float32
logits through small_gemm (what a sampled step computes today) against bfloat16 logits through
oneDNN (what the exact greedy head starts from), and the whole greedy head.

python scripts/head_bench.py [--rows 8,64] [--repeats 9]

Random weights; before each timed call a 256 MB buffer is rewritten so that the head's weights
come from memory, as they do in a decode step. Prints the median milliseconds a call.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native
from cbgen.models.llama import GreedyHead, bf16_matmul_fast, packed_linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: small_gemm is unavailable")
    if not bf16_matmul_fast():
        raise SystemExit("this CPU has no native bfloat16 matmul: the bf16 head is not used here")
    torch.manual_seed(0)
    weight = torch.randn(49152, 576) * 0.05
    panels = native.pack_panels(weight)
    head = GreedyHead(weight)
    flush = torch.zeros(64 << 20)

    def cold() -> None:
        flush.add_(1.0)

    for m in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(m, 576)
        hidden16 = hidden.to(torch.bfloat16)
        calls = {
            "float32 logits (small_gemm)": lambda _, h=hidden: native.small_gemm(h, panels, None),
            "bfloat16 logits (oneDNN)": lambda _, h=hidden16: packed_linear(h, head.packed, None),
            "greedy head (bf16 logits + exact selection)": lambda _, h=hidden: head(h),
        }
        times = [f"{name} {median_time(fn, args.repeats, setup=cold) * 1e3:6.2f} ms" for name, fn in calls.items()]
        print(f"{m:3d} rows: " + ", ".join(times))

if __name__ == "__main__":
    main()
