"""Time the CPU decode-attention kernel over a whole model's layers, from cold caches.

python scripts/decode_attention_bench.py --batch 64 --context 500 [--hot] [--layout runs] [--huge-pages]

Each of the --layers layers gets its own random K/V pool (SmolLM2's shape by default: 3 KV
heads of 64, 9 query heads) and every sequence's blocks are scattered over it, as in a long
run; one "step" calls the kernel once per layer, so no layer's K/V is in cache when its call
starts. --hot makes every sequence share the same blocks (K/V from cache: the arithmetic's
cost alone). Prints the median step time, the K/V bytes it read per second, and a plain
streaming read of 256 MB (torch.Tensor.sum) as the machine's reference bandwidth.
"""

from __future__ import annotations

import argparse
import math
import mmap

import torch
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native


def pool_tensor(shape: tuple[int, ...], huge_pages: bool) -> torch.Tensor:
    """An uninitialised float32 tensor; with huge_pages, in an anonymous mapping advised
    MADV_HUGEPAGE (this machine's transparent huge pages are opt-in: `madvise`)."""
    if not huge_pages:
        return torch.empty(shape)
    numel = math.prod(shape)
    buf = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.float32, count=numel).view(shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=500, help="tokens per sequence (each gets 0-39 fewer)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument(
        "--layout",
        choices=("scattered", "runs"),
        default="scattered",
        help="scattered: blocks anywhere in the pool; runs: each sequence's blocks consecutive",
    )
    ap.add_argument("--huge-pages", action="store_true", help="K/V pools in 2 MiB pages (MADV_HUGEPAGE)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: the kernel is unavailable")
    torch.manual_seed(0)
    b, bs, hkv, d = args.batch, args.block_size, args.kv_heads, args.head_dim
    nb = -(-args.context // bs)
    pool = b * nb + 8
    layers = [pool_tensor((2, pool, bs, hkv, d), args.huge_pages).normal_() for _ in range(args.layers)]
    if args.hot:
        block_table = torch.arange(nb).repeat(b, 1).int()
    elif args.layout == "runs":
        block_table = torch.arange(b * nb).view(b, nb).int()
    else:
        block_table = torch.randperm(pool)[: b * nb].view(b, nb).int()
    seq_lens = torch.tensor([max(1, args.context - (7 * i) % 40) for i in range(b)], dtype=torch.int32)
    q = torch.randn(b, hkv * args.group, d)

    def step() -> None:
        for kv in layers:
            native.paged_decode_f32(q, kv, block_table, seq_lens, d**-0.5)

    dt = median_time(step, args.repeats)
    kv_bytes = args.layers * int(seq_lens.sum()) * hkv * d * 2 * 4
    big = torch.randn(64 << 20)
    ref = median_time(big.sum, args.repeats)
    print(
        f"{b} sequences x ~{args.context} tokens x {args.layers} layers ({'hot' if args.hot else 'cold'}, "
        f"{args.layout}{', 2 MiB pages' if args.huge_pages else ''}): "
        f"{dt * 1000:.1f} ms a step, K/V read at {kv_bytes / dt / 1e9:.1f} GB/s; "
        f"a plain 256 MB read: {big.numel() * 4 / ref / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
