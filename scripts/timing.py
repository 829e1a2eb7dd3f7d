"""Shared by the microbenchmark scripts: the median wall time of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of fn: one untimed warm-up call, then the median of `repeats` calls."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
