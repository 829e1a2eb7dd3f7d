"""Would splitting the cores between memory-bound attention and compute-bound matmuls pay?

python scripts/split_batch_overlap.py --batch 64 --context 400

A decode step's attention waits on memory (it reads every sequence's K/V) while its matmuls
wait on arithmetic, and both take both cores in turn. This times a whole model's decode layers
(SmolLM2's shapes, random weights, each layer its own K/V pool, every sequence's blocks in
one run as prefill leaves them) two ways: the engine's way, each kernel on both cores; and
two threads, each running half the batch through all layers on one core, so that one half's
attention can overlap the other half's matmuls (each thread's kernels single-threaded, the
ctypes calls releasing the GIL). Prints the median step time of each.
"""

from __future__ import annotations

import argparse
import ctypes
import threading

import torch
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: the kernels are unavailable")
    omp = ctypes.CDLL("libgomp.so.1")  # the runtime the kernels are built against (-fopenmp)
    torch.manual_seed(0)
    b, bs, hkv, heads, d = args.batch, 16, 3, 9, 64
    nb = -(-args.context // bs)
    weights = [{k: native.pack_panels(torch.randn(*s) * 0.02) for k, s in SHAPES.items()} for _ in range(args.layers)]
    pools = [torch.randn(2, b * nb, bs, hkv, d) for _ in range(args.layers)]
    block_table = torch.arange(b * nb).view(b, nb).int()
    seq_lens = torch.tensor([max(1, args.context - (7 * i) % 40) for i in range(b)], dtype=torch.int32)
    x = torch.randn(b, heads * d)

    def layers(rows: slice) -> None:
        h, bt, sl = x[rows], block_table[rows], seq_lens[rows]
        for w, kv in zip(weights, pools, strict=True):
            q = native.small_gemm(h, w["qkv"], None)[:, : heads * d].reshape(-1, heads, d)
            o = native.paged_decode_f32(q, kv, bt, sl, d**-0.5)
            assert o is not None
            o = native.small_gemm(o.reshape(-1, heads * d), w["o"], None)
            h = native.small_gemm(native.silu_mul(native.small_gemm(o, w["gate_up"], None)), w["down"], None)

    def both_cores() -> None:
        omp.omp_set_num_threads(2)
        layers(slice(0, b))

    def halves() -> None:
        def one_core(rows: slice) -> None:
            omp.omp_set_num_threads(1)  # this thread's parallel regions only
            layers(rows)

        threads = [threading.Thread(target=one_core, args=(r,)) for r in (slice(0, b // 2), slice(b // 2, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    a, c = median_time(both_cores, args.repeats), median_time(halves, args.repeats)
    print(
        f"{b} sequences x ~{args.context} tokens x {args.layers} layers: every kernel on both cores "
        f"{a * 1000:.1f} ms a step; two halves, one core each {c * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
