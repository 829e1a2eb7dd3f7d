"""Memory read bandwidth, and the decode speed it allows a GGUF model at one sequence.

    python -m tools.mem_bandwidth [--gib 2] [--seconds 5] [--gguf FILE]

Sums a float32 buffer of --gib GiB (far larger than the last-level cache), one thread per core
each over its own slice (a read stream with one add per 4 bytes, far below the cores' add rate, so
the memory is the limit), pass after pass for --seconds; the best pass's bytes/s is the bandwidth
(a neighbour's load only slows a pass). With --gguf: the bytes one decode token reads from the
file (every tensor, except the token embedding of an untied model, of which it reads one row) and
the tokens/s bound they give at that bandwidth. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def read_bandwidth(gib: float, seconds: float) -> dict[str, float]:
    """The best pass's read rate over a float32 buffer of gib GiB, one thread per core each
    summing its own slice (NumPy's sum releases the GIL, so the threads run at once)."""
    threads = len(os.sched_getaffinity(0))
    n = int(gib * (1 << 30)) // 4 // threads * threads
    buf = np.ones(n, dtype=np.float32)  # written once: every page resident
    parts = np.split(buf, threads)
    best = float("inf")
    passes = 0
    total = 0.0
    deadline = time.perf_counter() + seconds
    with ThreadPoolExecutor(threads) as pool:
        while passes < 3 or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            total = sum(pool.map(lambda part: float(part.sum()), parts))
            best = min(best, time.perf_counter() - t0)
            passes += 1
    if abs(total - n) > 1e-3 * n:  # the sum is checked, so no read can be skipped
        raise RuntimeError(f"sum {total} != {n}")
    return {"gb_per_s": 4 * n / best / 1e9, "buffer_gib": gib, "passes": passes, "threads": threads}


def decode_bytes(path: Path) -> dict[str, Any]:
    """The bytes a one-sequence decode token reads from a GGUF file's tensors: all of them but
    the token embedding when an output tensor is separate (one row of it is read); with tied
    embeddings the head reads the embedding whole. KV cache reads are left out (small at short
    contexts)."""
    from cbgen.models.gguf_file import GGUFFile

    tensors = GGUFFile(str(path)).tensors
    sizes = {t.name: int(t.data.nbytes) for t in tensors}
    total = sum(sizes.values())
    untied = "output.weight" in sizes
    read = total - (sizes.get("token_embd.weight", 0) if untied else 0)
    return {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "tensor_bytes": total,
        "bytes_per_token": read,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="buffer size in GiB")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--gguf", type=Path, default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = read_bandwidth(args.gib, args.seconds)
    if args.gguf is not None:
        model = decode_bytes(args.gguf)
        model["bound_tokens_per_s"] = out["gb_per_s"] * 1e9 / model["bytes_per_token"]
        out["model"] = model
    print(json.dumps(out))


if __name__ == "__main__":
    main()
