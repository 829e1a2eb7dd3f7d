"""The fp32 matrix-multiply peak of this machine: the best of repeated large torch.mm calls
with every core's thread, printed as one JSON line {"gflops": ..., "n": ..., "threads": ...}.

FLOPs of one [n, n] x [n, n] product: 2 n^3. The best (not the mean) of the repeats is the
peak, so a neighbour's burst during one repeat does not lower it.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def matmul_peak(n: int = 2048, seconds: float = 4.0) -> dict[str, float]:
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    c = torch.empty(n, n, dtype=torch.float32)
    torch.mm(a, b, out=c)  # warm-up: first call picks kernels and faults pages in
    best = float("inf")
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return {
        "gflops": 2 * n**3 / best / 1e9,
        "n": float(n),
        "threads": float(threads),
        "reps": float(reps),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=4.0)
    a = p.parse_args()
    print(json.dumps(matmul_peak(a.n, a.seconds)))
