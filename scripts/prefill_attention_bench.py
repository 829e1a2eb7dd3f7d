"""cbgen's C prefill attention against torch's flash SDPA on the CPU, alone and inside the engine.

python scripts/prefill_attention_bench.py [--engine-prompts 128,400,1000,2000]

1. The kernel alone: one layer's attention for SmolLM2's shapes (9 query heads, 3 KV heads,
   D = 64) and a range of chunk lengths, with and without cached context, against the SDPA call
   the torch path makes (4-D, enable_gqa, is_causal or the [Q, L] mask): medians of 15 calls.
2. The engine: one prompt prefilled on an idle SmolLM2 engine, with the kernel and with it
   disabled (the chunk falls back to SDPA), alternating, median of five each, as milliseconds per
   prompt token.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native
from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine


def kernel_alone() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d = 9, 3, 64
    for qlen, ctx in [(64, 0), (128, 0), (400, 0), (400, 16), (1024, 0), (2048, 0), (1024, 1024)]:
        seq_len = ctx + qlen
        q, k, v = torch.randn(qlen, heads, d), torch.randn(seq_len, kv_heads, d), torch.randn(seq_len, kv_heads, d)
        flops = 4 * d * heads * (qlen * ctx + qlen * (qlen + 1) / 2)
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = torch.arange(seq_len)[None, :] <= ctx + torch.arange(qlen)[:, None] if ctx else None
        sdpa = median_time(
            lambda qt=qt, kt=kt, vt=vt, mask=mask: F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=d**-0.5, enable_gqa=True
            ),
            15,
        )
        ours = median_time(lambda q=q, k=k, v=v: native.prefill_attention_f32(q, k, v, d**-0.5), 15)
        print(
            f"chunk {qlen:5d} after {ctx:5d}: SDPA {sdpa * 1e3:6.2f} ms ({flops / sdpa / 1e9:4.0f} GFLOP/s), "
            f"C kernel {ours * 1e3:6.2f} ms ({flops / ours / 1e9:4.0f} GFLOP/s), {sdpa / ours:.2f}x"
        )


def in_engine(lengths: list[int]) -> None:
    engine = Engine(EngineConfig(max_num_seqs=1, kv_cache_memory=1 << 30))
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=1)
    kernel = native.prefill_attention_f32

    def prefill(n: int) -> float:
        engine.add_request(str(rng.random()), [rng.randrange(100, 40000) for _ in range(n)], params)
        seconds = engine.step().stats.duration_s
        while engine.has_unfinished_requests():
            engine.step()
        return seconds

    try:
        for n in lengths:
            times: dict[str, list[float]] = {"SDPA": [], "kernel": []}
            for _ in range(5):
                for name in times:
                    native.prefill_attention_f32 = kernel if name == "kernel" else (lambda *a: None)
                    times[name].append(prefill(n))
            a, b = (sorted(times[k])[2] / n * 1e3 for k in ("SDPA", "kernel"))
            print(f"prompt of {n:5d} tokens: {a:.3f} ms a token with SDPA, {b:.3f} with the kernel ({a / b:.2f}x)")
    finally:
        native.prefill_attention_f32 = kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-prompts", default="128,400,1000,2000", help="comma-separated prompt lengths")
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: the kernel is unavailable")
    kernel_alone()
    in_engine([int(n) for n in args.engine_prompts.split(",")])


if __name__ == "__main__":
    main()
