"""Where a decode step's time goes on a GPU, and which tile of the paged-attention kernel reads
the KV cache fastest: run on the GPU machine (offline, the checkout on PYTHONPATH).

    PYTHONPATH=. python3 -m tools.attention_sweep [--output FILE]

For a Llama-8B-shape decode batch (32 heads, 8 KV heads, head_dim 128, bf16, 16-token pages;
batch 256, context 512 unless told): the attention kernel alone at each key tile (BLOCK_N),
warp count and pipelining depth, as KV bytes read per second; then the layer's matmuls
(cuBLAS, [batch, hidden] x weight) as weight bytes read per second. Medians of CUDA-event
timings after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from tools import kernels_importable

kernels_importable(children=True)

import torch  # noqa: E402

from tools.gpu_fixtures import decode_batch  # noqa: E402


def _median_ms(fn: Any, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention(batch: int, context: int) -> list[dict[str, Any]]:
    from cbgen_kernels import attention as A

    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    dev = torch.device("cuda")
    step = decode_batch(batch, context, page, 1000, dev)
    cache = torch.randn(2, step.num_blocks, page, kv_heads, head_dim, device=dev).to(torch.bfloat16)
    query = torch.randn(batch, heads, head_dim, device=dev).to(torch.bfloat16)
    out = torch.empty_like(query)
    m = step.meta
    kv_bytes = batch * (context + 1) * 2 * kv_heads * head_dim * 2
    base = A.choose_config(heads, kv_heads, head_dim, 1)
    rows: list[dict[str, Any]] = []
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (None, 2, 3, 4):
                cfg = A.LaunchConfig(
                    base.block_q, base.block_m, block_n, 1, num_warps=warps, num_stages=stages
                )

                def run(cfg: A.LaunchConfig = cfg) -> None:
                    A._launch(
                        query,
                        cache,
                        m.block_table,
                        m.query_start_loc,
                        m.seq_lens,
                        0.1,
                        cfg,
                        out,
                        None,
                    )

                try:
                    ms = _median_ms(run)
                except Exception as e:  # too much shared memory, say
                    rows.append(
                        dict(block_n=block_n, warps=warps, stages=stages, error=str(e)[:200])
                    )
                    continue
                rows.append(
                    dict(
                        block_n=block_n,
                        warps=warps,
                        stages=stages,
                        ms=ms,
                        tb_s=kv_bytes / ms / 1e9,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def matmuls(batch: int) -> list[dict[str, Any]]:
    """One Llama-8B layer's linear layers at this batch: qkv, o, gate-up, down; the LM head."""
    dev = torch.device("cuda")
    shapes = {
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
        "lm_head": (4096, 128256),
    }
    rows: list[dict[str, Any]] = []
    for name, (k, n) in shapes.items():
        x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        ms = _median_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        rows.append(
            dict(
                name=name,
                ms=ms,
                tb_s=w.numel() * 2 / ms / 1e9,
                tflop_s=2 * batch * k * n / ms / 1e9,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("attention_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = {
        "device": torch.cuda.get_device_name(),
        "batch": args.batch,
        "context": args.context,
        "matmuls": matmuls(args.batch),
        "attention": attention(args.batch, args.context),
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
