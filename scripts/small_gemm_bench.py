"""Time cbgen's decode-sized matmul (small_gemm) over a whole model's layers, from cold caches.

python scripts/small_gemm_bench.py --rows 8,41,64,128 [--hot]

Every one of the --layers layers gets its own random weights in SmolLM2's shapes (qkv 960 x 576,
o 576 x 576, gate-up 3072 x 576, down 576 x 1536), packed once as the engine packs them, so a
pass over all of them streams ~425 MB of weights, as a decode step does. --hot repeats one
layer's weights instead (they stay in L3: the arithmetic alone). Prints the median time of a
pass and its GFLOP/s for each row count, next to torch's F.linear on the same weights.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,41,64,128", help="comma-separated batch sizes")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: small_gemm is unavailable")
    torch.manual_seed(0)
    distinct = 1 if args.hot else args.layers
    weights = []
    for _ in range(distinct):
        for n, k in SHAPES:
            w = torch.randn(n, k)
            weights.append((w, native.pack_panels(w)))
    weights = weights * (args.layers // distinct)
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
        flops = sum(2 * m * w.shape[0] * w.shape[1] for w, _ in weights)

        def ours(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, panels in weights:
                native.small_gemm(xs[w.shape[1]], panels, None)

        def plain(xs: dict[int, torch.Tensor] = xs) -> None:
            for w, _ in weights:
                F.linear(xs[w.shape[1]], w)

        a, b = median_time(ours, args.repeats), median_time(plain, args.repeats)
        print(
            f"{m:4d} rows, {args.layers} layers ({'hot' if args.hot else 'cold'}): small_gemm {a * 1000:6.1f} ms "
            f"({flops / a / 1e9:5.0f} GFLOP/s), F.linear {b * 1000:6.1f} ms ({flops / b / 1e9:5.0f} GFLOP/s)"
        )


if __name__ == "__main__":
    main()
