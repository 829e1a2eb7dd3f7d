"""One prompt chunk's attention three ways, on one thread: the C decode kernel (one query token
at a time, straight from a paged cache), the C prefill kernel and torch's SDPA (both with the
gather of the chunk's K/V from the cache, as the cpu backend calls them; the cache's blocks in
random order). Per shape the three calls alternate, so a neighbour's burst falls on all of
them; each time is the median of --reps calls, in ms, each ratio the median of the reps' ratios.

    python -m tools.prefill_attention_bench [--reps 15] [--heads 9 --kv-heads 3 --head-dim 64]
        [--shapes 16x0,4x512,...]

Rows: the K/V rows the chunk's query tokens read in all (query_len x mean keys a query), the
quantity the cpu backend splits chunks by (thresholds.prefill_split).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the kernels' OpenMP runtime starts

import torch

from cbgen.attention import torch_backend
from cbgen.cpu import build, kernels, thresholds

# (query tokens, cached context): docs/PERFORMANCE.md's AVX2 tables (--shapes' default)
SHAPES = [
    (16, 0),
    (32, 0),
    (4, 512),
    (64, 0),
    (8, 512),
    (128, 0),
    (16, 512),
    (32, 512),
    (256, 0),
    (64, 512),
    (512, 0),
    (512, 512),
]
BLOCK = 16


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_chunk(
    qlen: int, ctx: int, heads: int, kv_heads: int, d: int, reps: int
) -> tuple[list[float], list[float], list[float]]:
    """Per rep, the ms of the decode kernel, the prefill kernel and SDPA on one chunk."""
    seq_len, scale = ctx + qlen, d**-0.5
    query = torch.randn(qlen, heads, d)
    blocks = -(-seq_len // BLOCK)
    cache = torch.randn(2, blocks, BLOCK, kv_heads, d)
    order = torch.randperm(blocks)
    chunk = (0, qlen, seq_len, order)
    table = order.to(torch.int32).repeat(qlen, 1)
    lens = torch.arange(ctx + 1, seq_len + 1, dtype=torch.int32)
    calls: list[Callable[[], object]] = [
        lambda: kernels.paged_decode_f32(query, cache, table, lens, scale),
        lambda: kernels.prefill_attention_f32(
            query, *torch_backend.gather_context(cache, chunk), scale
        ),
        lambda: torch_backend.attend_chunk(
            query, *torch_backend.gather_context(cache, chunk), scale
        ),
    ]
    for fn in calls:  # warm-up
        fn()
    decode, prefill, sdpa = [], [], []
    for _ in range(reps):
        decode.append(_ms(calls[0]))
        prefill.append(_ms(calls[1]))
        sdpa.append(_ms(calls[2]))
    return decode, prefill, sdpa


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'16x0,4x512' -> [(16, 0), (4, 512)]: query tokens x cached context per chunk."""
    shapes = []
    for item in text.split(","):
        q, sep, c = item.strip().partition("x")
        if not sep or not q.isdigit() or not c.isdigit() or int(q) < 1:
            raise argparse.ArgumentTypeError(
                f"expected QUERYxCONTEXT,... (e.g. 16x0,4x512), got {item!r}"
            )
        shapes.append((int(q), int(c)))
    return shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=SHAPES,
        help="chunks as QUERYxCONTEXT,... (query tokens after cached context)",
    )
    args = parser.parse_args(argv)
    if build.load_library() is None:
        raise SystemExit(f"no C kernels to time: {build.native_status()}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(build.native_status())
    print(f"split of this build (rows, prefill kernel): {thresholds.prefill_split()}")
    print(
        "| chunk | rows | decode kernel | prefill kernel | SDPA | prefill / decode | prefill / SDPA |"
    )
    print("|---|---|---|---|---|---|---|")
    for qlen, ctx in args.shapes:
        decode, prefill, sdpa = bench_chunk(
            qlen, ctx, args.heads, args.kv_heads, args.head_dim, args.reps
        )
        # ratios of the calls made one after the other, then their median: a burst of other
        # load falls on one rep's three calls rather than on one kernel's column
        by_decode = statistics.median(p / x for p, x in zip(prefill, decode, strict=True))
        by_sdpa = statistics.median(p / x for p, x in zip(prefill, sdpa, strict=True))
        rows = int(qlen * (ctx + (qlen + 1) / 2))
        where = f"{qlen} after {ctx}" if ctx else f"{qlen}, no context"
        ms = " | ".join(f"{statistics.median(t):.3g}" for t in (decode, prefill, sdpa))
        print(f"| {where} | {rows:,} | {ms} | {by_decode:.2f} | {by_sdpa:.2f} |")


if __name__ == "__main__":
    main()
