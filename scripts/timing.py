"""Shared by the microbenchmark scripts: the median wall time of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[..., object], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    """Seconds per call of fn: one untimed warm-up call, then the median of `repeats` calls.
    With setup, each call is fn(setup()), setup's time left out (e.g. a fresh copy of an input
    that fn modifies)."""

    def once() -> float:
        arg = (setup(),) if setup is not None else ()
        t0 = time.perf_counter()
        fn(*arg)
        return time.perf_counter() - t0

    once()
    return sorted(once() for _ in range(repeats))[repeats // 2]
