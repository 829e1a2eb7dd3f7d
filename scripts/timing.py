"""Shared by the microbenchmark scripts: the median wall time of repeated calls, and engine
A/Bs whose decode steps alternate."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

from cbgen.engine.outputs import StepStats


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
    return median([once() for _ in range(repeats)])


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def alternating_decode_steps(
    steps: dict[Hashable, Callable[[], StepStats]], rows: int, busy: Callable[[], bool]
) -> dict[Hashable, list[float]]:
    """Call each step function in turn while busy() holds; for each, the seconds of its steps
    in which all `rows` sequences decoded (no prefill). Alternating spreads the host's drift
    over every variant alike."""
    times: dict[Hashable, list[float]] = {key: [] for key in steps}
    while busy():
        for key, step in steps.items():
            stats = step()
            if stats.num_prefill_tokens == 0 and stats.num_decode_tokens == rows:
                times[key].append(stats.duration_s)
    return times
