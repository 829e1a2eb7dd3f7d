"""Per-request latencies derived from the timestamps a Request collects.

All timestamps come from one monotonic clock (time.perf_counter), so for a request that
produced tokens: 0 <= queue_s <= ttft_s <= e2e_s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queue_s: float | None
    """Arrival to first scheduled."""
    ttft_s: float | None
    """Arrival to first token."""
    tpot_s: float | None
    """Mean time between output tokens (after the first)."""
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    e2e_s: float | None
    """Arrival to finish."""

    @classmethod
    def from_times(
        cls,
        arrival: float,
        first_scheduled: float | None,
        token_times: Sequence[float],
        finished: float | None,
    ) -> RequestMetrics:
        itls = [b - a for a, b in itertools.pairwise(token_times)]
        return cls(
            arrival_time=arrival,
            queue_s=None if first_scheduled is None else first_scheduled - arrival,
            ttft_s=token_times[0] - arrival if token_times else None,
            tpot_s=(token_times[-1] - token_times[0]) / len(itls) if itls else None,
            itl_p50_s=percentile(itls, 50) if itls else None,
            itl_p99_s=percentile(itls, 99) if itls else None,
            itl_max_s=max(itls) if itls else None,
            e2e_s=None if finished is None else finished - arrival,
        )

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)
